"""``flexmoba bench model_forward``: each arm's forward timed by part, logits only at the rows asked,
and the global and sliding-window layers told apart."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from benchmarks import model_forward
from flexmoba import MobaSpec
from flexmoba.model import GPT, ModelConfig

CONFIG = ModelConfig(vocab_size=64, n_layers=3, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, mlp_hidden=64,
                     max_seq_len=256, layer_types=["sliding", "sliding", "global"], sliding_window=16,
                     moba=MobaSpec(32, 2))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    path = tmp_path_factory.mktemp("forward") / "model.ckpt"
    torch.save({"hyper_parameters": {"config": dataclasses.asdict(CONFIG)},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
    return path


def test_every_arm_is_timed_by_part_with_logits_at_the_rows_asked(checkpoint, tmp_path, monkeypatch):
    rows = []
    real = model_forward.forward

    def counting(model, tokens, at):
        handle = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
        try:
            real(model, tokens, at)
        finally:
            handle.remove()

    monkeypatch.setattr(model_forward, "forward", counting)
    model_forward.main(["--ckpt", str(checkpoint), "--seq_len", "256", "--chunk_sizes", "32", "64", "--top_k", "2",
                        "--logit_rows", "40", "--rounds", "2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "model_forward.json").read_text())
    found = {row["arm"]: row for row in report["rows"]}
    assert list(found) == ["full", "moba:32:2", "moba:64:2"]
    assert rows == [40] * 3 * 3  # three arms, a warm-up and two rounds each
    for row in found.values():
        assert row["global_attention_s"] > 0 and row["sliding_attention_s"] > 0 and row["mlp_s"] > 0
        parts = sum(row[f"{p}_s"] for p in model_forward.PARTS)
        assert parts == pytest.approx(row["total_s"], rel=0.25)  # medians of parts need not sum to the median
    assert found["full"]["vs_full"] == 1


@pytest.mark.parametrize("extra, named", [(["--seq_len", "512"], "--seq_len"),
                                          (["--logit_rows", "300"], "--logit_rows"), (["--rounds", "0"], "--rounds")])
def test_a_mistake_is_one_line_naming_its_option(checkpoint, tmp_path, capsys, extra, named):
    with pytest.raises(SystemExit) as exited:
        model_forward.main(["--ckpt", str(checkpoint), "--seq_len", "256", *extra, "--out", str(tmp_path)])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and error.startswith(f"flexmoba: error: {named}:") and error.count("\n") == 1
