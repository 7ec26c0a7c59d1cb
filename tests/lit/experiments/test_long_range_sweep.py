"""Far context on the long-range corpus: gate recall on the copies' sources against planted selections,
and the tiny long-range sweep end to end, from data to the report's far-context tables."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from flexmoba.gate import Selection
from flexmoba.layout import chunk_layout
from flexmoba.model import GPT, ModelConfig
from flexmoba.spec import MobaSpec
from lit.experiments.long_range_eval import GroupSums, add_sequence, copy_queries, source_recall, window_of
from lit.experiments.sweep import main as sweep_main
from lit.training.long_range import LongRangeData

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "sweep" / "longrange_tiny.yaml"
S, CHUNK, TOP_K = 64, 8, 3
SPAN = np.array([[40, 8, 8]])  # copy of bytes 8-15 at 40-47: targets 39-46 copy targets 7-14, distance 32
EDGES = (16, 48)


def planted(select) -> Selection:
    """A one-head selection of ``S`` queries whose past chunks are ``select(query) -> [c1, c2]``."""
    past = torch.tensor([select(t) for t in range(S)]).view(1, 1, S, 2)
    valid = past < torch.arange(S).view(1, 1, S, 1) // CHUNK  # only chunks before the query's own
    return Selection(past.clamp(min=0) * valid, valid, chunk_layout(1, S, CHUNK, torch.device("cpu")),
                     MobaSpec(chunk_size=CHUNK, top_k=TOP_K))


def recall_rows(selection: Selection, skip: int = 0) -> list[dict]:
    found = copy_queries(SPAN, np.ones(S, dtype=bool), skip, EDGES, CHUNK, TOP_K)
    by_bin, by_window = GroupSums.zeros(len(EDGES) + 1, 1), GroupSums.zeros(4, 1)
    add_sequence(by_bin, by_window, [selection], found, window_of(found.queries, S, 4))
    return by_bin.rows()


def test_copy_queries_pair_each_copied_byte_with_its_source_in_a_past_chunk():
    found = copy_queries(SPAN, np.ones(S, dtype=bool), 0, EDGES, CHUNK, TOP_K)
    assert found.queries.tolist() == list(range(39, 47)) and found.sources.tolist() == list(range(7, 15))
    assert set(found.bins.tolist()) == {1}  # distance 32 in [16, 48)
    assert found.chance.tolist() == pytest.approx([2 / (t // CHUNK) for t in range(39, 47)])
    # Distance 4: targets 20-23 have their sources (16-19) in their own chunk, 2, and are left out.
    near = copy_queries(np.array([[20, 6, 16]]), np.ones(S, dtype=bool), 0, EDGES, CHUNK, TOP_K)
    assert near.queries.tolist() == [19, 24] and near.sources.tolist() == [15, 20]


def test_recall_is_one_when_every_query_selects_its_source_chunk():
    rows = recall_rows(planted(lambda t: [(t - 32) // CHUNK, (t - 32) // CHUNK] if t >= 32 else [0, 0]))
    assert rows[1]["pairs"] == 8 and rows[1]["recall"] == 1.0
    assert rows[0]["pairs"] == rows[2]["pairs"] == 0 and math.isnan(rows[0]["recall"])


def test_recall_is_zero_when_no_query_selects_its_source_chunk():
    rows = recall_rows(planted(lambda t: [2, 3]))  # the sources lie in chunks 0 and 1
    assert rows[1]["pairs"] == 8 and rows[1]["recall"] == 0.0


def test_recall_counts_each_byte_once():
    # Only the byte whose source is in chunk 0 (target 7, query 39) hits: 1 of 8.
    rows = recall_rows(planted(lambda t: [0, 3]))
    assert rows[1]["recall"] == pytest.approx(1 / 8)
    rows = recall_rows(planted(lambda t: [0, 3]), skip=1)  # that byte left out
    assert rows[1]["pairs"] == 7 and rows[1]["recall"] == 0.0


@pytest.fixture(scope="module")
def data(tmp_path_factory, random_files):
    root = random_files(tmp_path_factory.mktemp("corpus"), 8, 3 * 256 + 40)
    data = LongRangeData(root=str(root), seq_len=256, batch_size=2, val_fraction=0.25, test_fraction=0.0,
                         cache_dir=str(tmp_path_factory.mktemp("cache")), repeat_span_bytes=(16, 32),
                         repeat_distances=[32, 64, 128])
    data.prepare_data()
    data.setup("validate")
    return data


def test_a_gate_that_keeps_every_chunk_finds_every_source(data):
    model = GPT(ModelConfig(vocab_size=256, n_layers=2, d_model=16, n_heads=2,
                            moba=MobaSpec(chunk_size=8, top_k=32, backend="sdpa"))).eval()
    gate = source_recall(model, data, sequences=2, skip=4, windows=4)
    assert gate["layers"] == [0, 1] and gate["pairs"] > 0 and gate["recall"] == 1.0 and gate["chance"] == 1.0
    assert source_recall(GPT(ModelConfig(vocab_size=256, n_layers=1, d_model=16, n_heads=2, attention="full")),
                         data, sequences=1) is None


def test_bad_counts_name_the_parameter(data):
    model = GPT(ModelConfig(vocab_size=256, n_layers=1, d_model=16, n_heads=2))
    with pytest.raises(ValueError, match="^windows must be"):
        source_recall(model, data, sequences=1, windows=0)
    with pytest.raises(ValueError, match="^sequences must be"):
        source_recall(model, data, sequences=0)


# -- the tiny sweep end to end -------------------------------------------------------------


def test_tiny_long_range_sweep_reports_far_context(tmp_path, corpus_cache, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = yaml.safe_load(TINY.read_text())
    spec.update(out_dir=str(tmp_path / "sweep"), base_config=str(REPO / "configs" / "moba.yaml"))
    spec["cli_args"] += ["--data.cache_dir", str(corpus_cache)]
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(spec))
    sweep_main([str(config)])

    results = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "sweep").glob("*/result.json")}
    assert sorted(results) == sorted(f"{s}-{a}-seed0" for s in ("s1", "s2") for a in ("moba", "full", "hybrid"))
    for name, result in results.items():
        record = result["long_range"]
        assert [(b["low"], b["high"]) for b in record["bins"]] == [(0, 32), (32, 64), (64, 128), (128, None)]
        assert record["bins"][0]["count"] == 0 and all(b["count"] > 0 for b in record["bins"][1:]), name
        assert all(math.isfinite(b["copy"]) and math.isfinite(b["gap"]) for b in record["bins"][1:]), name
        assert len(record["by_position"]) == 256 // 32 and record["skip"] == 16
        gate = record.get("gate")
        if result["attention"] == "full":
            assert gate is None
            continue
        assert gate["chunk_size"] == 8 and gate["top_k"] == 3 and gate["pairs"] > 0
        assert len(gate["recall_by_layer"]) == int(name[1]), name  # s1: 1 layer, s2: 2 layers
        for row in gate["bins"][1:]:
            assert row["pairs"] > 0 and 0 <= row["recall"] <= 1 and 0 < row["chance"] <= 1, (name, row)
        assert gate["attention_now"] == (["full"] * int(name[1]) if result["attention"] == "hybrid"
                                         else ["moba"] * int(name[1]))

    report = (tmp_path / "sweep" / "report.md").read_text()
    for heading in ("## Far context: copy loss minus full attention's, by distance to the source",
                    "## Far context: MoBA's gate recall on the copies' sources", "## Far context verdict"):
        assert heading in report, heading
    gap_table = report.split("by distance to the source\n")[1].split("\n## ")[0]
    for label in ("| 32–64 |", "| 64–128 |", "| 128–∞ |"):
        assert label in gap_table, label
    assert "| 0–32 |" not in gap_table  # no copy lies closer than the corpus's first distance
    assert "| distance (bytes) | hybrid s1 | hybrid s2 | moba s1 | moba s2 |" in gap_table
    recall_section = report.split("## Far context: MoBA's gate recall")[1].split("\n## ")[0]
    assert "| distance (bytes) | hybrid s1 | hybrid s2 | moba s1 | moba s2 |" in recall_section
    assert "(chance " in recall_section.split("| 32–64 |")[1].split("\n")[0]
    verdict = report.split("## Far context verdict")[1].split("\n## ")[0]
    assert "- distance 32–64, s1: " in verdict and "gate recall" in verdict
    assert "- positions 224-256, s2: " in verdict
