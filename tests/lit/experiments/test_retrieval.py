"""Synthetic retrieval data, its metric, and the retrieval configs end to end."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lit.experiments.retrieval import (
    FILLER_BYTES,
    KEY_BYTES,
    VALUE_BYTES,
    RetrievalData,
    RetrievalDataset,
    RetrievalTask,
    answered,
    make_sample,
    markdown_table,
    to_example,
)
from lit.training.metrics import IGNORE_INDEX

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "retrieval"
TASK = RetrievalTask(n_pairs=6, n_queries=3, key_len=2, value_len=3)


def sample(task=TASK, length=200, depth=0.3, seed=0):
    return make_sample(task, length, depth, np.random.default_rng(seed))


def test_answers_are_where_they_claim():
    task = RetrievalTask(n_pairs=6, n_queries=3, key_len=2, value_len=3)
    s = sample(task)
    tokens = s.tokens
    for j in range(task.n_queries):
        key = tokens[s.key_positions[j] : s.key_positions[j] + task.key_len]
        value = tokens[s.value_positions[j] : s.value_positions[j] + task.value_len]
        query_key = tokens[s.query_positions[j] - task.key_len + 1 : s.query_positions[j] + 1]
        assert np.array_equal(key, query_key)  # the query asks the pair's key
        assert np.array_equal(tokens[s.answer_positions[j] + 1], value)  # targets of the answers are its value
        assert np.isin(key, KEY_BYTES).all() and np.isin(value, VALUE_BYTES).all()
    inputs, targets = to_example(s)
    answer_mask = targets != IGNORE_INDEX
    assert answer_mask.sum() == task.n_queries * task.value_len
    assert torch.equal(answer_mask.nonzero()[:, 0], torch.from_numpy(np.sort(s.answer_positions.reshape(-1))))
    assert torch.equal(targets[answer_mask], torch.from_numpy(tokens[1:].astype(np.int64))[answer_mask])
    # Keys and values occur only in the pair block and the queries; the rest is filler.
    special = np.flatnonzero(~np.isin(tokens, FILLER_BYTES) & (tokens != ord(" ")))
    pair_block = (special >= s.pair_start) & (special < s.pair_start + task.n_pairs * task.item_len)
    query_block = special >= len(tokens) - task.n_queries * task.item_len
    assert (pair_block | query_block).all()


def test_controls_are_respected():
    task = RetrievalTask(n_pairs=5, n_queries=2, key_len=1, value_len=2)
    for length in (task.min_length(), 300):
        assert len(to_example(sample(task, length, 0.5))[0]) == length
    first, last = sample(task, 300, 0.0), sample(task, 300, 1.0)
    assert first.pair_start == 0
    pairs_end = last.pair_start + task.n_pairs * task.item_len
    assert pairs_end == 300 + 1 - task.n_queries * task.item_len - 1  # flush against the queries' separator
    distances = [sample(task, 300, d).distances.mean() for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert all(a > b for a, b in zip(distances, distances[1:], strict=False))  # deeper needle -> closer to the queries
    keys = sample(task, 300).tokens
    assert np.isin(keys, KEY_BYTES).sum() == task.n_pairs + task.n_queries  # key_len 1: one byte per item
    with pytest.raises(ValueError):
        make_sample(task, task.min_length() - 1, 0.5, np.random.default_rng(0))
    with pytest.raises(ValueError):
        RetrievalTask(n_pairs=2, n_queries=3)


def test_same_seed_same_data_and_splits_differ():
    data, again = RetrievalData(seq_len=96, train_size=8), RetrievalData(seq_len=96, train_size=8)
    for split in ("train", "val", "test"):
        a, b = data.dataset(split), again.dataset(split)
        assert all(torch.equal(x, y) for i in range(4) for x, y in zip(a[i], b[i], strict=False))
    assert not torch.equal(data.dataset("train")[0][0], data.dataset("val")[0][0])
    assert not torch.equal(data.dataset("train")[0][0], RetrievalData(seq_len=96, seed=1).dataset("train")[0][0])
    fixed = RetrievalDataset(RetrievalTask(), 96, 4, seed=0, depths=[0.25])
    assert {fixed.sample(i).pair_start for i in range(4)} == {fixed.sample(0).pair_start}


def test_answered_metric_counts_whole_values():
    task = RetrievalTask(n_pairs=3, n_queries=2, value_len=2)
    examples = [to_example(sample(task, 64, 0.5, seed)) for seed in (0, 1)]
    inputs, targets = (torch.stack(t) for t in zip(*examples, strict=False))

    class Oracle(torch.nn.Module):  # predicts every target; breaks one value byte of row 1, query 0
        def forward(self, x):
            logits = torch.zeros(*x.shape, 256)
            wanted = targets.clamp(min=0).clone()
            wanted[1, (targets[1] != IGNORE_INDEX).nonzero()[0, 0]] += 1
            return logits.scatter(-1, wanted[..., None], 1.0)

    assert answered(Oracle(), inputs, targets, task).tolist() == [[True, True], [False, True]]


def test_markdown_table_layout():
    rows = [{"length": n, "depth": d, "accuracy": a, "distance": 0.0, "samples": 1}
            for n, d, a in [(64, 0.0, 1.0), (64, 1.0, 0.5), (128, 0.0, 0.0), (128, 1.0, 0.25)]]
    table = markdown_table(rows, "t")
    assert "| 64 | 100 | 50 | 75.0 |" in table and "| 128 | 0 | 25 | 12.5 |" in table


@pytest.mark.slow
def test_tiny_retrieval_fit_then_evaluate(tmp_path, flexmoba):
    """The MoBA retrieval config with the tiny overlay: fit, then the evaluation's table and heat map."""
    root = tmp_path / "run"
    flexmoba("fit", "--config", str(CONFIGS / "moba.yaml"), "--config", str(CONFIGS / "tiny.yaml"),
             "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false", cwd=tmp_path)
    ckpt = root / "checkpoints" / "last.ckpt"
    assert ckpt.exists()
    assert list(root.glob("csv/version_*/diagnostics/gate_step*.png"))
    out = tmp_path / "eval"
    command = [sys.executable, "-m", "lit.cli.main", "retrieval", "evaluate", "--ckpt", str(ckpt), "--out", str(out)]
    proc = subprocess.run(command,
                          cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "retrieval.json").read_text())
    assert {(r["length"], r["depth"]) for r in rows} == {(n, d) for n in (64, 128) for d in (0.0, 0.5, 1.0)}
    assert all(0 <= r["accuracy"] <= 1 and r["samples"] == 4 for r in rows)
    assert (out / "retrieval.png").read_bytes().startswith(b"\x89PNG")
    assert "| length \\ depth | 0.00 | 0.50 | 1.00 | mean |" in (out / "retrieval.md").read_text()
