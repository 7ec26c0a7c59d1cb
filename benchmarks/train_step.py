"""Training-step throughput of the flexmoba GPT: MoBA (per backend) against full attention.

One step = forward, next-byte cross-entropy, backward, AdamW step, on random bytes, B
sequences of S tokens. The model is the default model (``flexmoba.model.ModelConfig()``, the
one ``configs/moba.yaml`` trains), with ``--config``'s ``model.config`` fields if given;
``full`` rows are the same model with ``attention: full`` (causal SDPA). MoBA rows set
``moba_backend``:

    gather  exact sparse MoBA (queries regrouped per selected chunk), differentiable on CPU
    sdpa    the dense [B, H, S, S] mask into SDPA, the baseline MoBA path
    flex    compiled FlexAttention (CUDA only for training)

Target: on CPU at S = 8K, the MoBA training step at least 2x faster than through the
dense-mask path, i.e. ``vs moba sdpa`` >= 2 on the gather row.

    flexmoba bench train_step [--seq_lens 2048 8192] [--backends gather sdpa] [--repeats 3]
    flexmoba bench train_step --config configs/pretrained/smollm2_scaling.yaml --backends auto --hybrids 3 \
        --seq_lens 4096 8192 --rounds 2 --repeats 2     # the continued-scaling study's arms, alternating
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    DEFAULT_OUT,
    OUT_HELP,
    OneLineArgumentParser,
    finish_report,
    median_seconds,
    peak_extra_mb,
    print_row,
    settle_malloc,
    timing_repeats,
)
from flexmoba.model import GPT, ModelConfig

COLUMNS = [
    ("round", "round"), ("seq_len", "S"), ("batch", "B"), ("attention", "attention"), ("backend", "backend"),
    ("full_last", "full last layers"),
    ("step_ms", "step (ms)"), ("tokens_per_s", "tokens/s"), ("vs_moba_sdpa", "vs moba sdpa"),
    ("vs_full", "vs full"), ("peak_mb", "peak (MB)"), ("note", "note"),
]


def load_config(path: Path | None) -> ModelConfig:
    """The default model, with the ``model.config`` fields of a LightningCLI YAML file if given."""
    if path is None:
        return ModelConfig()
    import yaml

    model = yaml.safe_load(path.read_text()).get("model", {})
    return ModelConfig(**model.get("config", {}))


def make_step(config: ModelConfig, seq_len: int, batch: int, device: torch.device):
    """A closure running one optimizer step of a fresh model on fixed random bytes ``[B, S + 1]``."""
    torch.manual_seed(0)
    model = GPT(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        return loss
    return step


def variants(backends: list[str], with_full: bool, hybrids: list[int]) -> list[tuple[str, str, int]]:
    """(attention, backend, last layers full) rows per S; the references (full, moba sdpa) first, then each
    backend in every layer and in each layer hybrid of ``hybrids``."""
    ordered = sorted(backends, key=lambda b: b != "sdpa")
    return ([("full", "-", 0)] if with_full else []) + [("moba", b, n) for b in ordered for n in [0, *hybrids]]


def measure(config: ModelConfig, seq_len: int, args, device) -> dict:
    step = make_step(config, seq_len, args.batch_size, device)
    seconds = median_seconds(step, args.repeats, warmup=args.warmup)
    return {"step_ms": seconds * 1e3, "tokens_per_s": args.batch_size * seq_len / seconds,
            "peak_mb": peak_extra_mb(step, device)}


def run_row(config: ModelConfig, seq_len: int, args, device) -> dict:
    try:
        return measure(config, seq_len, args, device)
    except RuntimeError as error:  # out of memory, or a backend that cannot train here
        message = str(error).lower()
        if "out of memory" in message or "can't allocate" in message:
            return {"note": "out of memory"}
        if "cannot compute gradients" in message:
            return {"note": "no backward on this device"}
        raise


def add_ratios(rows: list[dict]) -> None:
    """Throughput relative to MoBA through the dense-mask path and to full attention, per S and round."""
    for row in rows:
        same_s = [r for r in rows if r["seq_len"] == row["seq_len"] and r["round"] == row["round"]
                  and "tokens_per_s" in r]
        for key, attention, backend in (("vs_moba_sdpa", "moba", "sdpa"), ("vs_full", "full", "-")):
            ref = next((r for r in same_s if r["attention"] == attention and r["backend"] == backend
                        and r["full_last"] == 0), None)
            if ref and "tokens_per_s" in row:
                row[key] = row["tokens_per_s"] / ref["tokens_per_s"]


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_lens", type=int, nargs="+", default=[2048, 8192], help="sequence lengths S")
    p.add_argument("--backends", nargs="+", default=["flex", "gather", "sdpa"] if cuda else ["gather", "sdpa"],
                   choices=("auto", "flex", "gather", "sdpa"), help="MoBA backends to time")
    p.add_argument("--no_full", action="store_true", help="skip the full-attention rows")
    p.add_argument("--hybrids", type=int, nargs="*", default=[],
                   help="also time MoBA with the last N layers full, for each N given")
    p.add_argument("--rounds", type=int, default=1,
                   help="times every row is measured, the rows alternating (ratios within a round)")
    p.add_argument("--config", type=Path, default=None,
                   help="LightningCLI YAML whose model.config fields change the default model")
    p.add_argument("--batch_size", type=int, default=1, help="sequences per step")
    p.add_argument("--repeats", type=timing_repeats, default=3, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        settle_malloc()
    base = load_config(args.config)
    print(f"model: {base}", flush=True)
    if args.rounds < 1 or any(n < 1 or n > base.n_layers for n in args.hybrids):
        sys.stderr.write(f"flexmoba: error: --rounds must be >= 1 and --hybrids in [1, {base.n_layers}], got "
                         f"{args.rounds} and {args.hybrids}\n")
        raise SystemExit(2)
    rows = []
    for seq_len in args.seq_lens:
        for round_ in range(1, args.rounds + 1):
            for attention, backend, full_last in variants(args.backends, not args.no_full, args.hybrids):
                moba = dataclasses.replace(base.moba, backend=backend) if attention == "moba" else base.moba
                config = dataclasses.replace(base, attention=attention, moba=moba,
                                             full_attention_last_n_layers=full_last)
                row = {"round": round_, "seq_len": seq_len, "batch": args.batch_size, "attention": attention,
                       "backend": backend, "full_last": full_last, "device": device.type,
                       **run_row(config, seq_len, args, device)}
                rows.append(row)
                add_ratios(rows)
                print_row(row, COLUMNS)
    add_ratios(rows)
    print()
    finish_report(f"train_step_{device.type}", rows, COLUMNS, args.out)
    for row in rows:
        if row["attention"] == "moba" and row["backend"] != "sdpa" and "vs_moba_sdpa" in row and not row["full_last"]:
            print(f"S={row['seq_len']}: MoBA {row['backend']} step is {row['vs_moba_sdpa']:.2f}x the throughput "
                  f"of the dense-mask path (target at S=8192 on CPU: >= 2x)")


if __name__ == "__main__":
    sys.exit(main())
