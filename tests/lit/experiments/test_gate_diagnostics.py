"""Gate diagnostics callback: hand-computed gate recall and needle hits through a validation run."""

import lightning as L
import pytest
import torch

from flexmoba import MobaSpec, moba_attention
from flexmoba.model import ModelConfig
from lit.experiments.gate_diagnostics import GateDiagnostics, capture_queries_keys, gate_stats
from lit.experiments.retrieval import RetrievalData
from lit.training.module import LitLM

SEQ, CHUNK = 64, 16  # 4 chunks


def tiny_module(top_k: int) -> LitLM:
    torch.manual_seed(0)
    config = ModelConfig(n_layers=2, d_model=32, n_heads=2, moba=MobaSpec(CHUNK, top_k, backend="sdpa"),
                         full_attention_last_n_layers=1)
    return LitLM(config, seq_len=SEQ, position_window=16, trailing_window=16)


def validate_with_callback(module: LitLM, tmp_path) -> tuple[GateDiagnostics, dict[str, float]]:
    callback = GateDiagnostics(max_sequences=4)
    data = RetrievalData(seq_len=SEQ, batch_size=4, val_size=4, n_pairs=2, n_queries=2)
    trainer = L.Trainer(callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, accelerator="cpu", devices=1)
    logged = trainer.validate(module, datamodule=data, verbose=False)[0]
    return callback, logged


def test_recall_and_needle_hits_are_one_when_top_k_covers_all_chunks(tmp_path):
    callback, logged = validate_with_callback(tiny_module(top_k=SEQ // CHUNK), tmp_path)
    for layer in (0, 1):  # layer 1 is full attention: diagnosed as MoBA would have routed it
        assert logged[f"gate/recall_l{layer}"] == pytest.approx(1.0, abs=1e-5)
        assert logged[f"gate/needle_hit_l{layer}"] == 1.0
        assert torch.allclose(callback.last_stats[layer].recall_by_position, torch.ones(SEQ), atol=1e-5)
    assert [s.kind for s in callback.last_stats] == ["moba", "full"]
    assert list(tmp_path.glob("diagnostics/gate_step*.png"))


def test_recall_matches_uniform_attention_by_hand(tmp_path):
    """Zero queries attend uniformly over the t + 1 causal keys; with top_k=1 MoBA keeps only the
    own chunk's ``t % chunk + 1`` of them, so recall(t) = (t % chunk + 1) / (t + 1)."""
    module = tiny_module(top_k=1)
    for block in module.model.blocks:
        torch.nn.init.zeros_(block.attn.wq.weight)
    callback, logged = validate_with_callback(module, tmp_path)
    t = torch.arange(SEQ, dtype=torch.float32)
    expected = (t % CHUNK + 1) / (t + 1)
    for layer, stats in enumerate(callback.last_stats):
        assert torch.allclose(stats.recall_by_position, expected, atol=1e-5)
        assert logged[f"gate/recall_l{layer}"] == pytest.approx(expected[CHUNK:].mean().item(), abs=1e-5)
        assert stats.distances.sum() == 0  # top_k=1 selects no past chunk
    # top_k=1: a query "selects" the needle's chunk exactly when the needle is in its own chunk.
    val = RetrievalData(seq_len=SEQ, val_size=4, n_pairs=2, n_queries=2).dataset("val")
    same_chunk = [v // CHUNK == q // CHUNK for s in map(val.sample, range(4))
                  for v, q in zip(s.value_positions, s.query_positions, strict=False)]
    assert logged["gate/needle_hit_l0"] == pytest.approx(sum(same_chunk) / len(same_chunk)) != 1.0


def test_captured_queries_keys_reproduce_the_layer_output():
    """q and k from the hooks (RoPE re-applied) give the attention layer's own output."""
    module = tiny_module(top_k=2)
    model = module.model
    tokens = torch.randint(0, 256, (2, SEQ))
    (q, k), _ = capture_queries_keys(model, tokens)
    inputs = {}
    handle = model.blocks[0].attn.register_forward_hook(lambda m, args, out: inputs.update(x=args[0], out=out))
    model(tokens)
    handle.remove()
    attn = model.blocks[0].attn
    v = attn.wv(inputs["x"]).view(2, SEQ, 2, 16).transpose(1, 2)
    y = moba_attention(q, k, v, chunk_size=CHUNK, top_k=2, backend="sdpa")
    assert torch.allclose(attn.wo(y.transpose(1, 2).reshape(2, SEQ, 32)), inputs["out"], atol=1e-5)
    assert len(gate_stats(model, tokens)) == 2
