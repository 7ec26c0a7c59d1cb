"""q/k/v captured from a trained flexmoba checkpoint, and the locality of real selections.

Used by ``benchmarks.attention --inputs checkpoint --ckpt PATH``. The checkpoint is a
Lightning checkpoint written by ``flexmoba fit`` (``hyper_parameters["config"]`` holds the
:class:`flexmoba.model.ModelConfig` fields, ``state_dict`` keys start with ``model.``); a
plain ``{"config": ..., "state_dict": ...}`` dict works too.

q/k/v are taken exactly as each attention layer feeds its attention: forward hooks on the
layer's ``wq``/``wk``/``wv`` projections, then the model's own head split and RoPE.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flexmoba.model import GPT, ModelConfig, capture_attention_inputs
from flexmoba.gate import select_chunks

DISTANCE_BINS = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 8), (9, 16), (17, 32), (33, None)]


def load_model(path: str | Path, device: torch.device) -> GPT:
    """A :class:`GPT` in eval mode with the checkpoint's weights (and phase override, if any)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    config = ckpt.get("hyper_parameters", {}).get("config", ckpt.get("config"))
    if config is None:
        raise ValueError(f"{path}: no model config (expected hyper_parameters['config'] or 'config')")
    if isinstance(config, dict):
        config = {k: v for k, v in config.get("init_args", config).items() if not k.startswith("_")}
        config = ModelConfig(**config)
    elif not isinstance(config, ModelConfig):
        config = ModelConfig(**vars(config))
    state = ckpt.get("state_dict", ckpt)
    model_state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    model = GPT(config)
    model.load_state_dict(model_state or state)
    if ckpt.get("attention_override"):
        model.set_attention_override(ckpt["attention_override"])
    return model.eval().to(device)


def corpus_tokens(seq_len: int) -> torch.Tensor:
    """``[1, S]`` byte tokens of Python source (the training corpus), held-out files first."""
    try:
        from lit.data import default_corpus_dir, list_python_files, split_of

        root = default_corpus_dir()
        files = list_python_files(root)
        files.sort(key=lambda f: split_of(f[0], 0.05, 0.05) == "train")  # val/test files first
        paths = [os.path.join(root, rel) for rel, _ in files]
    except ImportError:  # lit not importable: any Python files next to torch will do
        paths = sorted(str(p) for p in Path(torch.__file__).parent.rglob("*.py"))
    data = bytearray()
    for p in paths:
        if len(data) >= seq_len:
            break
        data += Path(p).read_bytes()
    if len(data) < seq_len:
        raise ValueError(f"corpus has only {len(data)} bytes, need {seq_len}")
    return torch.tensor(list(data[:seq_len]), dtype=torch.long)[None]


@torch.no_grad()
def capture_qkv(model: GPT, seq_len: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per layer ``(q [1, H, S, D], k [1, H_kv, S, D], v [1, H_kv, S, D])`` in the model's dtype."""
    cfg = model.config
    if device.type == "cpu" and cfg.moba_backend in ("auto", "flex"):
        cfg.moba_backend = "gather"  # same math, no flex compile just to run the model on CPU
    tokens = corpus_tokens(seq_len).to(device)
    return [tuple(x.contiguous() for x in qkv) for qkv in capture_attention_inputs(model, tokens)]


def bin_label(lo: int, hi: int | None) -> str:
    return f"d{lo}" if hi == lo else (f"d{lo}+" if hi is None else f"d{lo}-{hi}")


@torch.no_grad()
def locality(q: torch.Tensor, k: torch.Tensor, chunk_size: int, top_k: int) -> dict:
    """How far back MoBA's selected past chunks are, for ``q: [B, H, S, D]``, ``k: [B, H_kv, S, D]``.

    distance = own chunk - selected chunk (>= 1). Returns the mean distance, the fraction of
    selected past chunks at distance 1 (the immediately preceding chunk), that fraction if
    each query picked its past chunks uniformly at random, and a histogram (fractions of
    the selected past chunks per distance bin).
    """
    sel = select_chunks(q, k, chunk_size=chunk_size, top_k=top_k)
    own = sel.layout.local_chunk[:, None, :, None]  # [B, 1, S, 1]
    dist = (own - sel.past_chunks)[sel.past_valid].float()
    n = max(dist.numel(), 1)
    # Uniform baseline: a query with m past chunks picks min(top_k - 1, m) of them, the
    # preceding one with probability min(top_k - 1, m) / m; as a share of all picks:
    m = sel.layout.local_chunk.float()  # [B, S]
    picks = m.clamp(max=top_k - 1)
    uniform = float((picks / m.clamp(min=1)).sum() / picks.sum().clamp(min=1))
    row = {
        "chunk_size": chunk_size, "top_k": top_k, "selected_past": int(dist.numel()),
        "mean_distance": float(dist.mean()) if dist.numel() else 0.0,
        "frac_prev": float((dist == 1).sum() / n),
        "frac_prev_uniform": uniform,
    }
    for lo, hi in DISTANCE_BINS:
        in_bin = (dist >= lo) & (dist <= (hi if hi is not None else float("inf")))
        row[bin_label(lo, hi)] = float(in_bin.sum() / n)
    return row


LOCALITY_COLUMNS = [
    ("inputs", "inputs"), ("layer", "layer"), ("seq_len", "S"), ("chunk_size", "chunk"), ("top_k", "top-k"),
    ("mean_distance", "mean distance"), ("frac_prev", "frac prev chunk"),
    ("frac_prev_uniform", "frac prev (uniform)"),
] + [(bin_label(lo, hi), bin_label(lo, hi)) for lo, hi in DISTANCE_BINS]
