"""Does a model trained on the long-range corpus use far context? Its loss on the copied spans
against the same spans' first occurrences, by distance to the source, and its loss by position.

    python -m lit.experiments.long_range_pilot --ckpt runs/pilot/checkpoints/last.ckpt \
        --out docs/long_context/pilot [--sequences 16] [--skip 16] [--windows 8]

The checkpoint must come from a ``flexmoba fit --data lit.training.long_range.LongRangeData`` run;
its corpus (the data module's saved arguments) is rebuilt from the cache and its validation
sequences scored. A model that copies has a copy loss far below the source loss (the gap).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flexmoba.checkpoint import load_model, read_checkpoint
from lit.training.long_range import LongRangeData
from lit.training.metrics import repeat_span_losses


def pilot_data(checkpoint: dict) -> LongRangeData:
    """The checkpoint's long-range corpus, set up for validation."""
    saved = {k: v for k, v in (checkpoint.get("datamodule_hyper_parameters") or {}).items() if not k.startswith("_")}
    if "repeat_share" not in saved:
        raise SystemExit("flexmoba: error: --ckpt: the checkpoint was not trained on LongRangeData; "
                         "train with --data lit.training.long_range.LongRangeData")
    data = LongRangeData(**saved)
    data.prepare_data()
    data.setup("validate")
    return data


@torch.no_grad()
def score(model, data: LongRangeData, sequences: int, skip: int, windows: int) -> dict:
    """Repeat-span losses and per-window loss over the first ``sequences`` validation sequences."""
    dataset = data.datasets["val"]
    n = min(sequences, len(dataset))
    edges = tuple(data.plan.distances)  # the corpus's own bins (4K, 8K, 16K at 32K)
    total, window_sum, window_count = None, torch.zeros(windows), torch.zeros(windows)
    for i in range(n):
        inputs, targets = (t[None] for t in dataset[i])
        logits = model(inputs)
        token_loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none",
                                     ignore_index=-100).view_as(targets)
        part = repeat_span_losses(token_loss, targets, [data.repeats_of("val", i)], edges=edges, skip=skip)
        total = part if total is None else total + part
        valid = (targets[0] != -100).float()
        window = torch.arange(targets.shape[1]) * windows // targets.shape[1]
        window_sum.index_add_(0, window, token_loss[0] * valid)
        window_count.index_add_(0, window, valid)
    means = total.means()
    means["bins"] = [{"low": low, "high": high, **row} for (low, high), row in means["bins"].items()]
    span = data.seq_len // windows
    means["by_position"] = [{"from": w * span, "to": (w + 1) * span, "loss": float(window_sum[w] / window_count[w])}
                            for w in range(windows)]
    means["sequences"], means["skip"], means["seq_len"] = n, skip, data.seq_len
    return means


def report(result: dict, ckpt: str, seconds: float) -> str:
    lines = [f"Checkpoint `{ckpt}`, {result['sequences']} validation sequences of {result['seq_len']} bytes, "
             f"the first {result['skip']} bytes of each span left out; scored in {seconds:.0f} s.", "",
             "| distance to source | copy loss | first-occurrence loss | gap (nats/byte) | bytes scored |",
             "|---|---|---|---|---|"]
    for row in result["bins"]:
        high = "∞" if row["high"] is None else f"{row['high']:,}"
        lines.append(f"| {row['low']:,}–{high} | {row['copy']:.3f} | {row['source']:.3f} | {row['gap']:.3f} | "
                     f"{row['count']:,} |")
    lines.append(f"| all | {result['copy']:.3f} | {result['source']:.3f} | {result['gap']:.3f} | |")
    lines += ["", "| positions | loss (nats/byte) |", "|---|---|"]
    lines += [f"| {w['from']:,}–{w['to']:,} | {w['loss']:.3f} |" for w in result["by_position"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--ckpt", required=True, help="checkpoint of a LongRangeData run")
    parser.add_argument("--out", required=True, help="folder for pilot.md and pilot.json")
    parser.add_argument("--sequences", type=int, default=16, help="validation sequences scored (default: 16)")
    parser.add_argument("--skip", type=int, default=16, help="first bytes of each span not scored (default: 16)")
    parser.add_argument("--windows", type=int, default=8, help="position windows (default: 8)")
    args = parser.parse_args(argv)
    if not Path(args.ckpt).is_file():
        parser.error(f"--ckpt: {args.ckpt} is not a file")
    started = time.perf_counter()
    checkpoint = read_checkpoint(args.ckpt)
    result = score(load_model(checkpoint), pilot_data(checkpoint), args.sequences, args.skip, args.windows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pilot.json").write_text(json.dumps(result, indent=2))
    text = report(result, args.ckpt, time.perf_counter() - started)
    (out / "pilot.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
