"""The long-range pilot's scorer: copy vs first-occurrence loss and loss by position of a model."""

import math

import pytest
import torch

from lit.experiments import long_range_pilot
from lit.experiments.long_range_eval import score
from lit.training.long_range import LongRangeData

SEQ_LEN = 512


@pytest.fixture(scope="module")
def data(tmp_path_factory, random_files):
    root = random_files(tmp_path_factory.mktemp("corpus"), 12, 3 * SEQ_LEN + 40)
    data = LongRangeData(root=str(root), seq_len=SEQ_LEN, batch_size=2, val_fraction=0.25, test_fraction=0.0,
                         cache_dir=str(tmp_path_factory.mktemp("cache")), repeat_span_bytes=(16, 48),
                         repeat_share=0.3)
    data.prepare_data()
    data.setup("validate")
    return data


def uniform_model(tokens):
    """Equal logits over the 256 bytes: every target costs ln 256."""
    return torch.zeros(*tokens.shape, 256)


def test_a_uniform_model_scores_ln_256_everywhere_and_no_gap(data):
    result = score(uniform_model, data, sequences=3, skip=4, windows=4)
    assert result["copy"] == pytest.approx(math.log(256)) and result["source"] == pytest.approx(math.log(256))
    assert result["gap"] == pytest.approx(0.0, abs=1e-9)
    assert [w["loss"] for w in result["by_position"]] == pytest.approx([math.log(256)] * 4, rel=1e-5)
    assert [(w["from"], w["to"]) for w in result["by_position"]] == [(0, 128), (128, 256), (256, 384), (384, 512)]
    scored = sum(row["count"] for row in result["bins"])
    expected = sum(max(0, int(length) - 4) for i in range(3) for _, length, _ in data.repeats_of("val", i))
    assert 0 < scored <= expected  # a span's last byte has no target inside the sequence


def test_a_checkpoint_of_another_data_module_is_one_line():
    with pytest.raises(SystemExit, match=r"^flexmoba: error: --ckpt: the checkpoint was not trained on LongRangeData"):
        long_range_pilot.pilot_data({"datamodule_hyper_parameters": {"seq_len": 128, "_class_path": "x"}})


def test_the_report_has_a_recall_row_per_scored_bin_and_a_column_per_moba_layer():
    gate = {"chunk_size": 64, "top_k": 3, "layers": [0, 2],
            "bins": [{"low": 0, "high": 128, "pairs": 0, "recall_by_layer": [float("nan")] * 2, "chance": float("nan")},
                     {"low": 128, "high": None, "pairs": 1500, "recall_by_layer": [0.25, 0.75], "chance": 0.2}]}
    lines = long_range_pilot.recall_table(gate)
    assert "| distance to source | bytes | layer 0 | layer 2 | chance |" in lines
    assert lines[-1] == "| 128–∞ | 1,500 | 0.250 | 0.750 | 0.200 |"
    assert not any(line.startswith("| 0–128") for line in lines)
