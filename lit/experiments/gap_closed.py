"""How much of MoBA's training-free gap continued training closes, per position window.

    flexmoba gap-closed --before docs/pretrained/training_free --moba runs/eval/moba --control runs/eval/full \\
        --out docs/pretrained/continued

Three ``flexmoba context-eval`` folders over the same documents: ``before``, the pretrained model (arms
``full`` and ``moba:CHUNK:TOPK``); ``moba``, the model after continued training with MoBA; ``control``, after
the same continued training with full attention (it adapts to the corpus too). Per document and window:

- the gap before: the pretrained model with MoBA minus itself with full attention;
- the gap after: the MoBA-trained model with MoBA minus the control with full attention;
- closed: ``1 - mean(gap after) / mean(gap before)`` (none where the gap before is under 0.001 nats),
  with a 95% percentile interval from resampling the documents (2,000 draws, seeded), so the interval
  carries the documents' spread of both gaps.

Writes ``gap_closed.json``, ``gap_closed.md`` and ``gap_closed.png`` into ``out``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lit.experiments.context_eval import FULL, Arm, read_records
from lit.training import checks, figures
from lit.training.errors import UsageError
from lit.training.options import parse_dataclass

DRAWS = 2000
NO_GAP = 1e-3  # nats/token: a window where training-free MoBA is this close to full attention has no gap


def window_table(folder: Path, arm: str, option: str) -> dict[str, list[float]]:
    """Document -> its window losses and trailing loss (last), of one arm of a context-eval folder."""
    records = read_records(folder / "records.jsonl")
    rows = {r["document"]: [*r["windows"], r["trailing"]] for r in records
            if r["kind"] == "position" and r["arm"] == arm}
    if not rows:
        raise UsageError(option, f"{folder} holds no position records of arm {arm!r}",
                         "give a context-eval folder that scored it")
    return rows


def closed_share(before: np.ndarray, after: np.ndarray, seed: int = 0) -> dict:
    """``before``, ``after``: ``[documents]`` gaps of one window. The share closed and its bootstrap interval."""
    if abs(before.mean()) < NO_GAP:  # MoBA is exact there (e.g. the first chunks): nothing to close
        return {"gap_before": float(before.mean()), "gap_after": float(after.mean()), "closed": None, "low": None,
                "high": None}
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(before), (DRAWS, len(before)))
    shares = 1 - after[draws].mean(1) / before[draws].mean(1)
    low, high = np.percentile(shares, [2.5, 97.5])
    return {"gap_before": float(before.mean()), "gap_after": float(after.mean()),
            "closed": float(1 - after.mean() / before.mean()), "low": float(low), "high": float(high)}


SAME = ("seq_len", "window", "trailing")  # the context-eval settings the three folders must share


def eval_settings(option: str, folder: Path) -> dict:
    """The settings of the context-eval that wrote ``folder`` (its job.json); UsageError naming ``option`` when
    it is missing, a file, or not a context-eval folder."""
    if not folder.exists():
        raise UsageError(option, f"{folder} does not exist", "give a folder flexmoba context-eval wrote")
    if not folder.is_dir():
        raise UsageError(option, f"{folder} is a file, not a folder", "give a folder flexmoba context-eval wrote")
    for name in ("records.jsonl", "job.json"):
        if not (folder / name).is_file():
            kind = "records" if name == "records.jsonl" else name
            raise UsageError(option, f"{folder} holds no context-eval {kind}", "give a folder flexmoba "
                             "context-eval wrote (its job.json and records.jsonl)")
    try:
        settings = json.loads((folder / "job.json").read_text())
    except json.JSONDecodeError:
        settings = None
    if not isinstance(settings, dict) or not all(isinstance(settings.get(k), int) for k in SAME):
        raise UsageError(option, f"{folder}/job.json is not a context-eval's", "give a folder flexmoba "
                         "context-eval wrote")
    return settings


def odd_one(values: dict[str, object]) -> tuple[str, str] | None:
    """Of three options' ``values``, ``(the option that differs, the others)``: the one the other two agree
    against, else the second (the first is the reference); None when all agree."""
    options = list(values)
    if len(set(map(repr, values.values()))) == 1:
        return None
    for option in options:
        others = [o for o in options if o != option]
        if values[others[0]] == values[others[1]]:
            return option, " and ".join(others)
    return options[1], options[0]


def scored_words(settings: dict) -> str:
    scored = settings.get("scored_windows")
    return "" if scored is None else f", scored_windows {scored}"


def check_agreement(folders: dict[str, Path], settings: dict[str, dict], documents: dict[str, set]) -> None:
    """The three folders scored the same positions of the same documents; UsageError naming the one that differs."""
    shown = {option: ", ".join(f"{k} {s[k]}" for k in SAME) + scored_words(s) for option, s in settings.items()}
    odd = odd_one(shown)
    if odd:
        option, others = odd
        raise UsageError(option, f"{folders[option]} was scored at {shown[option]}; the others ({others}) at "
                         f"{shown[others.split(' and ')[0]]}", "give context-eval folders of the same --seq_len, "
                         "--window, --scored_windows and --trailing")
    odd = odd_one({option: sorted(names) for option, names in documents.items()})
    if odd:
        option, others = odd
        reference = documents[others.split(" and ")[0]]
        apart = sorted(documents[option] ^ reference)
        raise UsageError(option, f"{folders[option]} scored other documents than the others ({others}): "
                         f"{len(documents[option])} against {len(reference)}, {len(apart)} in one only "
                         f"({', '.join(apart[:3])}{', ...' if len(apart) > 3 else ''})",
                         "give context-eval folders of the same documents (the same --root, --patterns, --split "
                         "and --documents; a killed context-eval finishes when run again)")


def gap_closed(before: Path, moba: Path, control: Path, arm: str) -> dict:
    folders = {"--before": before, "--moba": moba, "--control": control}
    settings = {option: eval_settings(option, folder) for option, folder in folders.items()}
    tables = {"base_full": window_table(before, FULL, "--before"), "base_moba": window_table(before, arm, "--before"),
              "moba": window_table(moba, arm, "--moba"), "control": window_table(control, FULL, "--control")}
    if set(tables["base_full"]) != set(tables["base_moba"]):
        raise UsageError("--before", f"{before}'s arms full and {arm} scored other documents",
                         "finish its context-eval (run it again: it goes on where it stopped)")
    check_agreement(folders, settings, {"--before": set(tables["base_full"]), "--moba": set(tables["moba"]),
                                        "--control": set(tables["control"])})
    documents = sorted(tables["base_full"])
    if len(documents) < 2:
        raise UsageError("--before", f"the folders share {len(documents)} documents",
                         "score at least 2 (context-eval --documents)")
    arrays = {k: np.array([t[d] for d in documents]) for k, t in tables.items()}  # [documents, windows + 1]
    gap_before = arrays["base_moba"] - arrays["base_full"]
    gap_after = arrays["moba"] - arrays["control"]
    window = settings["--before"]["window"]
    scored = settings["--before"].get("scored_windows") or range(gap_before.shape[1] - 1)
    columns = [f"{i * window}-{(i + 1) * window}" for i in sorted(scored)] + ["trailing"]
    return {"arm": arm, "documents": documents, "windows": columns,
            "rows": [closed_share(gap_before[:, i], gap_after[:, i]) | {"window": c} for i, c in enumerate(columns)]}


def markdown(result: dict, command: str) -> str:
    lines = [f"# Continued training: the share of the training-free gap closed ({result['arm']}, "
             f"{len(result['documents'])} held-out documents)", "", f"`{command}`", "",
             "| window | gap before | gap after | closed | 95% interval |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        closed = ("no gap before | –" if row["closed"] is None
                  else f"{row['closed']:.0%} | [{row['low']:.0%}, {row['high']:.0%}]")
        lines.append(f"| {row['window']} | {row['gap_before']:+.3f} | {row['gap_after']:+.3f} | {closed} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    rows = [r for r in result["rows"] if r["window"] != "trailing"]
    x = range(len(rows))
    fig = figures.figure(7, 3.5)
    axis = fig.subplots()
    axis.plot(x, [r["gap_before"] for r in rows], marker="o", label="before (pretrained, MoBA - full)")
    axis.plot(x, [r["gap_after"] for r in rows], marker="o", label="after (MoBA-trained - full-trained control)")
    axis.axhline(0, color="black", linewidth=0.5)
    axis.set_xticks(list(x), [r["window"] for r in rows], rotation=30, fontsize=7)
    axis.set_ylabel("nats/token")
    axis.set_title(f"MoBA's gap to full attention, {len(result['documents'])} documents")
    axis.legend(fontsize=8)
    figures.save(fig, path)


@dataclass
class GapClosedJob:
    """What ``flexmoba gap-closed`` compares.

    Args:
        before: the context-eval folder of the pretrained model.
        moba: the context-eval folder of the model continued with MoBA.
        control: the context-eval folder of the model continued with full attention.
        out: the folder for gap_closed.json, .md and .png; a folder that holds files is refused
            (--overwrite true replaces them).
        arm: the MoBA arm compared (as context-eval names it).
        overwrite: replace what ``out`` holds.
    """

    before: str
    moba: str
    control: str
    out: str
    arm: str = "moba:512:3"
    overwrite: bool = False


def check_arm(text: str) -> None:
    try:
        arm = Arm.parse(text)
    except UsageError as error:
        raise UsageError("--arm", error.problem, "give moba:CHUNK:TOPK or moba:CHUNK:TOPK:N, as context-eval "
                         "named it") from None
    if arm.name == FULL:
        raise UsageError("--arm", "full is not a MoBA arm", "give the MoBA arm compared, e.g. moba:512:3")


def main(argv: list[str] | None = None) -> dict:
    job = parse_dataclass(GapClosedJob, argv, prog="flexmoba gap-closed", description=__doc__)
    check_arm(job.arm)
    out = checks.output_folder("--out", job.out, job.overwrite)
    result = gap_closed(Path(job.before), Path(job.moba), Path(job.control), job.arm)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gap_closed.json").write_text(json.dumps(result, indent=1))
    (out / "gap_closed.md").write_text(markdown(result, "flexmoba gap-closed " + " ".join(sys.argv[1:])))
    plot(result, out / "gap_closed.png")
    print(f"gap-closed: {closing_words(result['rows'][-1])}; see {out}")
    return result


def closing_words(trailing: dict) -> str:
    """What the closing line says of the trailing window: the share closed, or that it had no gap to close."""
    if trailing["closed"] is None:
        return (f"trailing window: no gap before ({trailing['gap_before']:+.3f} nats/token, under {NO_GAP}: "
                "MoBA equals full attention there), nothing to close")
    return (f"trailing window {trailing['closed']:.0%} of the gap closed "
            f"[{trailing['low']:.0%}, {trailing['high']:.0%}]")
