"""A whole model's forward at long context, per attention arm, and where its time goes.

One flexmoba checkpoint (e.g. ``flexmoba import-hf --source gemma3-270m``'s), batch 1, fp32, no grad,
as ``flexmoba context-eval`` runs it: the layers over ``--seq_len`` tokens, then logits at
``--logit_rows`` positions only (the scored windows; at 32K positions and Gemma's 262K vocabulary the
output layer over every position would be most of the work). Arms: full attention, and MoBA (chunk,
``--top_k``) for each of ``--chunk_sizes``, in the layers the model attends globally; sliding-window
layers keep their window in every arm. The arms run in interleaved rounds in one process; each part
(global attention, sliding-window attention, MLPs, the rest of the layers, logits) is timed by module
hooks in the same calls. Token ids are drawn at random (seeded): the work of every part is fixed by the
shapes, MoBA's included (each query attends ``top_k`` chunks whatever it selects).

    flexmoba bench model_forward --ckpt runs/pretrained/gemma3-270m/model.ckpt [--seq_len 32768]
        [--chunk_sizes 512 2048] [--top_k 3] [--logit_rows 12288] [--rounds 2] [--out benchmarks/results]
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_OUT, OUT_HELP, OneLineArgumentParser, fail, finish_report, print_row
from flexmoba.checkpoint import checkpoint_config, load_model, read_checkpoint

PARTS = ("global_attention", "sliding_attention", "mlp", "other", "logits")
COLUMNS = [("arm", "arm"), ("seq_len", "tokens"), ("total_s", "forward (s)"), ("tok_s", "tokens/s"),
           ("global_attention_s", "global attention (s)"), ("sliding_attention_s", "sliding attention (s)"),
           ("mlp_s", "MLPs (s)"), ("other_s", "rest of the layers (s)"), ("logits_s", "logits (s)"),
           ("logit_rows", "logit rows"), ("vs_full", "full / this")]


class PartTimer:
    """Seconds spent in each part of a model's forward, summed over calls, from module hooks."""

    def __init__(self, model):
        self.seconds: dict[str, float] = defaultdict(float)
        self.handles = []
        for block in model.blocks:
            kind = "sliding_attention" if block.attn.active_kind == "sliding" else "global_attention"
            self.watch(block.attn, kind)
            self.watch(block.mlp, "mlp")
        self.watch(model.lm_head, "logits")

    def watch(self, module, part: str) -> None:
        started = {}
        self.handles.append(module.register_forward_pre_hook(lambda m, a: started.__setitem__(0, time.perf_counter())))
        self.handles.append(module.register_forward_hook(
            lambda m, a, out: self.seconds.__setitem__(part, self.seconds[part] + time.perf_counter() - started[0])))

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


def forward(model, tokens: torch.Tensor, rows: torch.Tensor) -> None:
    """``tokens: [1, S]``: the layers over all S, logits at ``rows`` only, 2,048 rows at a time."""
    hidden = model.hidden(tokens)[0]
    for chunk in rows.split(2048):
        model.lm_head(hidden[chunk])


def arms(args) -> dict[str, dict]:
    """Arm name -> the :func:`flexmoba.checkpoint.load_model` overrides that make the model attend so."""
    found = {"full": {"attention": "full", "full_attention_last_n_layers": 0}}
    for chunk in args.chunk_sizes:
        found[f"moba:{chunk}:{args.top_k}"] = {"attention": "moba", "full_attention_last_n_layers": 0,
                                               "moba": {"chunk_size": chunk, "top_k": args.top_k,
                                                        "backend": args.backend}}
    return found


def measure(args) -> list[dict]:
    checkpoint = read_checkpoint(args.ckpt)
    config = checkpoint_config(checkpoint)
    if config.max_seq_len is not None and args.seq_len > config.max_seq_len:
        fail(f"--seq_len: {args.seq_len} tokens exceed the model's context of {config.max_seq_len}")
    if args.logit_rows > args.seq_len:
        fail(f"--logit_rows: {args.logit_rows} exceeds --seq_len {args.seq_len}")
    models = {name: load_model(checkpoint, **overrides) for name, overrides in arms(args).items()}
    timers = {name: PartTimer(model) for name, model in models.items()}
    tokens = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(args.seq_len - args.logit_rows, args.seq_len)
    runs: dict[str, list[dict]] = defaultdict(list)
    with torch.no_grad():
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for name, model in models.items():
                started = time.perf_counter()
                forward(model, tokens, rows)
                parts = timers[name].take()
                parts["total"] = time.perf_counter() - started
                if round_:
                    runs[name].append(parts)
                print(f"round {round_}{' (warm-up)' if not round_ else ''}: {name} {parts['total']:.1f} s", flush=True)
    return [summarise(name, runs[name], runs["full"], args) for name in models]


def summarise(name: str, runs: list[dict], full: list[dict], args) -> dict:
    median = {part: statistics.median(r.get(part, 0.0) for r in runs) for part in ("total", *PARTS[:3], "logits")}
    layers = [r["total"] - sum(r.get(p, 0.0) for p in PARTS if p != "other") for r in runs]
    row = dict(arm=name, seq_len=args.seq_len, total_s=median["total"], tok_s=args.seq_len / median["total"],
               other_s=statistics.median(layers), logit_rows=args.logit_rows,
               vs_full=statistics.median(f["total"] / r["total"] for f, r in zip(full, runs, strict=True)))
    row.update({f"{part}_s": median[part] for part in PARTS if part != "other"})
    return row


def main(argv=None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a flexmoba checkpoint (flexmoba import-hf's model.ckpt)")
    parser.add_argument("--seq_len", type=int, default=32768)
    parser.add_argument("--chunk_sizes", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--top_k", type=int, default=3)
    parser.add_argument("--backend", default="auto", help="MoBA's backend (default auto)")
    parser.add_argument("--logit_rows", type=int, default=12288, help="positions with logits (6 windows of 2K)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after one warm-up round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--name", default="model_forward", help="report file name")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    args = parser.parse_args(argv)
    for option in ("seq_len", "top_k", "logit_rows", "rounds"):
        if getattr(args, option) < 1:
            fail(f"--{option}: must be a positive int, got {getattr(args, option)}")
    if not Path(args.ckpt).is_file():
        fail(f"--ckpt: {args.ckpt} is not a file; give a flexmoba checkpoint (flexmoba import-hf's model.ckpt)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args)
    for row in rows:
        print_row(row, COLUMNS)
    finish_report(args.name, rows, COLUMNS, args.out)


if __name__ == "__main__":
    main()
