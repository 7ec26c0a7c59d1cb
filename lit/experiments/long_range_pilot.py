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

from flexmoba.checkpoint import load_model, read_checkpoint
from lit.experiments.long_range_eval import SKIP, evaluate
from lit.training.long_range import LongRangeData
from lit.training.metrics import bin_label


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


def report(result: dict, ckpt: str, seconds: float) -> str:
    lines = [f"Checkpoint `{ckpt}`, {result['sequences']} validation sequences of {result['seq_len']} bytes, "
             f"the first {result['skip']} bytes of each span left out; scored in {seconds:.0f} s.", "",
             "| distance to source | copy loss | first-occurrence loss | gap (nats/byte) | bytes scored |",
             "|---|---|---|---|---|"]
    for row in result["bins"]:
        lines.append(f"| {bin_label(row['low'], row['high'])} | {row['copy']:.3f} | {row['source']:.3f} | "
                     f"{row['gap']:.3f} | {row['count']:,} |")
    lines.append(f"| all | {result['copy']:.3f} | {result['source']:.3f} | {result['gap']:.3f} | |")
    lines += ["", "| positions | loss (nats/byte) |", "|---|---|"]
    lines += [f"| {w['from']:,}–{w['to']:,} | {w['loss']:.3f} |" for w in result["by_position"]]
    if "gate" in result:
        lines += ["", *recall_table(result["gate"])]
    return "\n".join(lines) + "\n"


def recall_table(gate: dict) -> list[str]:
    """MoBA's gate recall on the copies' sources by distance bin, per layer, against chance."""
    layers = gate["layers"]
    lines = [f"MoBA gate recall on the copies' sources (chunk {gate['chunk_size']}, top-{gate['top_k']}; "
             "share of copied bytes whose query selects the chunk holding the source, mean over heads):", "",
             "| distance to source | bytes | " + " | ".join(f"layer {i}" for i in layers) + " | chance |",
             "|---|---|" + "---|" * len(layers) + "---|"]
    for row in gate["bins"]:
        if not row["pairs"]:
            continue
        cells = " | ".join(f"{r:.3f}" for r in row["recall_by_layer"])
        lines.append(f"| {bin_label(row['low'], row['high'])} | {row['pairs']:,} | {cells} | {row['chance']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--ckpt", required=True, help="checkpoint of a LongRangeData run")
    parser.add_argument("--out", required=True, help="folder for pilot.md and pilot.json")
    parser.add_argument("--sequences", type=int, default=16, help="validation sequences scored (default: 16)")
    parser.add_argument("--skip", type=int, default=SKIP, help=f"first bytes of each span not scored (default: {SKIP})")
    parser.add_argument("--windows", type=int, default=8, help="position windows (default: 8)")
    args = parser.parse_args(argv)
    if not Path(args.ckpt).is_file():
        parser.error(f"--ckpt: {args.ckpt} is not a file")
    started = time.perf_counter()
    checkpoint = read_checkpoint(args.ckpt)
    result = evaluate(load_model(checkpoint), pilot_data(checkpoint), args.sequences, args.skip, args.windows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pilot.json").write_text(json.dumps(result, indent=2))
    text = report(result, args.ckpt, time.perf_counter() - started)
    (out / "pilot.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
