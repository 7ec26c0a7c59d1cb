"""Loss by position and passkey retrieval of one checkpoint at long context, per attention arm.

    flexmoba context-eval --ckpt runs/pretrained/smollm2/model.ckpt --out runs/context-eval/smollm2
    flexmoba context-eval --ckpt ... --out ... --arms '[full, moba:512:3, moba:128:3, moba:512:3:10]'

An arm is how every layer attends, the weights unchanged: ``full``; ``moba:CHUNK:TOPK``, MoBA in every
layer; ``moba:CHUNK:TOPK:N``, the layer hybrid with the last N layers full. Two measurements per arm:

- **Loss by position.** The first ``seq_len + 1`` tokens of each of ``documents`` held-out documents (the
  ``split`` of the corpus, files split by path hash exactly as the data modules split them, so with the
  training config's ``val_fraction``/``test_fraction`` these documents were never trained on; documents
  shorter than ``seq_len + 1`` tokens are passed over, in name order). Per document, the mean loss of
  each ``window`` of positions and of the trailing ``trailing`` positions; per arm the mean over
  documents with a 95% t interval, and each arm's paired difference to ``full`` with its interval.
- **Passkey retrieval** (Mohtashami & Jaggi 2023): ``The pass key is NNNNN. Remember it.`` hidden at
  ``depth`` of a repeated filler of ``length`` tokens, then ``What is the pass key? The pass key is``.
  A trial is answered when every token of the key is the argmax under teacher forcing (greedy decoding
  would print it). ``retrieval_trials`` keys per (length, depth) cell, the same keys for every arm.

Every result is appended to ``records.jsonl`` as it comes, so a killed run started again with the same
arguments goes on where it stopped; ``results.json``, ``results.md``, ``windows.png`` and
``retrieval.png`` are rebuilt from the records at the end. A progress line is printed per result.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lit.training import checks, figures
from lit.training.errors import UsageError
from lit.training.options import parse_dataclass
from lit.training.statistics import mean_interval
from lit.training.ticker import Ticker, progress_seconds

# torch, numpy, flexmoba and the data modules are imported where they are used: ``--help`` (and the modules
# that import Arm or ContextEvalJob from here) do not wait for them. Models are flexmoba.model.GPT, configs
# ModelConfig, losses torch tensors; unannotated here, since jsonargparse, reading ContextEvalJob, runs this
# module's ``if TYPE_CHECKING:`` imports.

FULL = "full"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"


@dataclass(frozen=True)
class Arm:
    """How every layer attends: full attention, or MoBA (chunk, top-k) with the last ``full_last`` layers full."""

    name: str
    chunk_size: int | None = None
    top_k: int | None = None
    full_last: int = 0

    @classmethod
    def parse(cls, text: str) -> Arm:
        if text == FULL:
            return cls(FULL)
        parts = text.split(":")
        if parts[0] != "moba" or len(parts) not in (3, 4) or not all(p.isdigit() for p in parts[1:]):
            raise UsageError("--arms", f"{text!r} is not an arm", "give full, moba:CHUNK:TOPK or moba:CHUNK:TOPK:N "
                             "(the last N layers full)")
        numbers = [int(p) for p in parts[1:]] + [0] * (4 - len(parts))
        return cls(text, *numbers)

    def label(self) -> str:
        if self.name == FULL:
            return "full attention"
        hybrid = f", last {self.full_last} layers full" if self.full_last else ""
        return f"MoBA {self.chunk_size}/{self.top_k}{hybrid}"

    def config(self, base):
        """The checkpoint's :class:`flexmoba.model.ModelConfig` ``base`` attending as this arm;
        :class:`UsageError` (``--arms``) when that model cannot (more full layers than it has, a chunk its MoBA
        settings refuse)."""
        if self.full_last > base.n_layers:
            raise UsageError("--arms", f"{self.name} makes the last {self.full_last} layers full, the checkpoint's "
                             f"model has {base.n_layers} layers",
                             f"give N at most {base.n_layers} (moba:{self.chunk_size}:{self.top_k}:{base.n_layers}), "
                             "or leave the arm out")
        overrides = self.overrides()
        try:
            if "moba" in overrides:
                overrides["moba"] = dataclasses.replace(base.moba, **overrides["moba"])
            return dataclasses.replace(base, **overrides)
        except (TypeError, ValueError) as error:
            raise UsageError("--arms", f"{self.name}: {error}", "give an arm this model can run") from None

    def overrides(self) -> dict:
        """The :func:`flexmoba.checkpoint.load_model` overrides that make a model attend as this arm."""
        if self.name == FULL:
            return {"attention": "full", "full_attention_last_n_layers": 0}
        return {"attention": "moba", "moba": {"chunk_size": self.chunk_size, "top_k": self.top_k},
                "full_attention_last_n_layers": self.full_last}


@dataclass
class ContextEvalJob:
    """What ``flexmoba context-eval`` measures.

    Args:
        ckpt: a flexmoba checkpoint (``flexmoba import-hf``'s model.ckpt, or a run's last.ckpt).
        out: the folder for records.jsonl, results.json, results.md and the figures; a folder holding
            another job's records is refused (--overwrite true replaces them).
        arms: full, moba:CHUNK:TOPK, moba:CHUNK:TOPK:N (last N layers full); with full among them, each
            other arm's paired difference to it is reported.
        seq_len: tokens per document scored (at most the model's context).
        documents: held-out documents scored per arm.
        window: width of the position windows.
        scored_windows: the windows scored, by index (0: the first ``window`` positions), default all;
            logits are computed only at the positions of these windows and the trailing ones (at 32K
            positions and a large vocabulary the output layer is most of a forward's work).
        trailing: the last positions, reported on their own.
        root: the corpus folder (default: this Python's standard library).
        patterns: file globs of the corpus.
        split: the split the documents come from (the training config's held-out split).
        val_fraction: as the training data's (the split is by path hash).
        test_fraction: as the training data's.
        tokenizer: a tokenizer.json (default: the checkpoint's own).
        retrieval_lengths: passkey prompt lengths in tokens (empty: no retrieval).
        retrieval_depths: where the key sits, as a share of the filler.
        retrieval_trials: keys per (length, depth) cell.
        threads: torch threads (default: torch's).
        device: where the models run (``cpu``, ``cuda``); results do not depend on it beyond rounding.
        overwrite: replace the records another job left in ``out``.
    """

    ckpt: str
    out: str
    arms: list[str] = field(default_factory=lambda: [FULL, "moba:512:3", "moba:256:3", "moba:512:3:10"])
    seq_len: int = 8192
    documents: int = 20
    window: int = 1024
    scored_windows: list[int] | None = None
    trailing: int = 256
    root: str | None = None
    patterns: list[str] = field(default_factory=lambda: ["*.py"])  # lit.training.data.DEFAULT_PATTERNS
    split: str = "test"
    val_fraction: float = 0.05
    test_fraction: float = 0.2
    tokenizer: str | None = None
    retrieval_lengths: list[int] = field(default_factory=lambda: [4096, 8192])
    retrieval_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    retrieval_trials: int = 2
    threads: int | None = None
    device: str = "cpu"
    overwrite: bool = False

    def settings(self) -> dict:
        """What fixes the records' meaning (a resumed job must agree on it); ``scored_windows`` only when set,
        so records written before it existed still resume."""
        return {k: v for k, v in asdict(self).items() if k not in ("out", "threads", "device", "overwrite")
                and not (k == "scored_windows" and v is None)}

    def scored(self) -> list[int]:
        """The indices of the windows scored."""
        every = list(range(self.seq_len // self.window))
        return every if self.scored_windows is None else sorted(set(self.scored_windows))

    def positions(self):
        """``[seq_len]`` bool: the positions whose next-token loss is computed (scored windows, trailing)."""
        import torch

        asked = torch.zeros(self.seq_len, dtype=torch.bool)
        for index in self.scored():
            asked[index * self.window: (index + 1) * self.window] = True
        asked[-self.trailing:] = True
        return asked


# -- data -------------------------------------------------------------------------------------


def load_tokenizer_text(job: ContextEvalJob, checkpoint: dict) -> str:
    from flexmoba.checkpoint import checkpoint_config, checkpoint_tokenizer

    if job.tokenizer is not None:
        if not Path(job.tokenizer).is_file():
            raise UsageError("--tokenizer", f"{job.tokenizer} is not a file", "give a tokenizer.json")
        return Path(job.tokenizer).read_text()
    text = checkpoint_tokenizer(checkpoint)
    if text is None:
        vocab_size = checkpoint_config(checkpoint).vocab_size
        raise UsageError("--tokenizer", f"{job.ckpt} carries no tokenizer",
                         f"give --tokenizer, the tokenizer.json of its model's {vocab_size} tokens")
    return text


def load_tokenizer(job: ContextEvalJob, checkpoint: dict):
    """The tokenizer of the job (``--tokenizer``, else the checkpoint's own), refused when its ids are not the
    model's: a tokenizer larger than the model's ``vocab_size`` gives ids past its embedding, a smaller one
    given by ``--tokenizer`` is another model's (the checkpoint's own may be smaller: a padded embedding)."""
    from tokenizers import Tokenizer

    from flexmoba.checkpoint import checkpoint_config

    text = load_tokenizer_text(job, checkpoint)
    source = job.tokenizer or f"{job.ckpt}'s tokenizer"
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises a bare Exception on a file it cannot read
        raise UsageError("--tokenizer", f"{source} is not a tokenizer.json ({str(error).splitlines()[0]})",
                         "give the tokenizer.json the model was trained with") from None
    size, vocab_size = tokenizer.get_vocab_size(), checkpoint_config(checkpoint).vocab_size
    if size > vocab_size or (job.tokenizer is not None and size != vocab_size):
        raise UsageError("--tokenizer", f"{source} holds {size} tokens, the checkpoint's model {vocab_size} "
                         "(its vocab_size)", "give the tokenizer the model was trained with (flexmoba import-hf "
                         "writes it beside model.ckpt), or another --ckpt")
    return tokenizer


def held_out_documents(job: ContextEvalJob, tokenizer) -> list[tuple[str, list[int]]]:
    """``(name, the first seq_len + 1 token ids)`` of the first ``documents`` long enough documents of the
    split, in name order; UsageError when the split holds too few."""
    from lit.training.data import default_root, list_files, select_files
    from lit.training.tokenizer import document_text

    root = job.root or default_root()
    files = select_files(list_files(root, job.patterns), val_fraction=job.val_fraction,
                         test_fraction=job.test_fraction, min_doc_bytes=job.seq_len + 1, max_files=None,
                         max_bytes=None)[job.split]
    chosen = []
    for name, _ in sorted(files):
        ids = tokenizer.encode(document_text(root, name, None)[0]).ids
        if len(ids) > job.seq_len:
            chosen.append((name, ids[: job.seq_len + 1]))
        if len(chosen) == job.documents:
            return chosen
    raise UsageError("--documents", f"the {job.split} split of {root} holds {len(chosen)} documents of more than "
                     f"{job.seq_len} tokens, fewer than {job.documents}",
                     "ask for fewer, a shorter --seq_len, or a larger --test_fraction")


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> tuple[list[int], list[int]]:
    """``(prompt ids, key ids)``: the needle at ``depth`` of a filler that makes prompt + key ``length`` tokens."""
    needle = tokenizer.encode(NEEDLE.format(key=key)).ids
    question = tokenizer.encode(QUESTION).ids
    answer = tokenizer.encode(f" {key}").ids
    filler_unit = tokenizer.encode(FILLER).ids
    room = length - len(needle) - len(question) - len(answer)
    if room <= 0:
        raise UsageError("--retrieval_lengths", f"{length} tokens cannot hold the needle and the question")
    filler = (filler_unit * (room // len(filler_unit) + 1))[:room]
    at = int(depth * room)
    return filler[:at] + needle + filler[at:] + question, answer


# -- scoring ----------------------------------------------------------------------------------


LOGIT_ROWS = 2048  # positions whose logits exist at once: [2048, V], 2 GB of fp32 at Gemma's 262K vocabulary


def token_losses(model, ids: list[int], positions=None):
    """Cross-entropy of each next token, ``[len(ids) - 1]`` fp32 (on the host); with ``positions`` (bool,
    ``[len(ids) - 1]``) NaN where it is False: logits are computed only where it is True, ``LOGIT_ROWS``
    positions at a time."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        tokens = torch.tensor(ids, dtype=torch.long, device=model_device(model))[None]
        hidden = model.hidden(tokens[:, :-1])[0]
        asked = torch.ones(hidden.shape[0], dtype=torch.bool) if positions is None else positions.cpu()
        losses = torch.full((hidden.shape[0],), float("nan"))
        rows = asked.nonzero()[:, 0]
        for chunk in rows.split(LOGIT_ROWS):
            at = chunk.to(hidden.device)
            logits = model.lm_head(hidden[at]).float()
            losses[chunk] = F.cross_entropy(logits, tokens[0, 1:][at], reduction="none").cpu()
        return losses


def model_device(model):
    return next(model.parameters()).device


def answers(model, prompt: list[int], answer: list[int]) -> tuple[bool, float]:
    """Whether every answer token is the argmax after the prompt (teacher forced), and the answer's mean loss."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        ids = prompt + answer
        tokens = torch.tensor(ids, dtype=torch.long, device=model_device(model))[None]
        logits = model.lm_head(model.hidden(tokens[:, :-1])[0, len(prompt) - 1 :]).float()  # the answer's only
        target = torch.tensor(answer, device=logits.device)
        return bool((logits.argmax(-1) == target).all()), float(F.cross_entropy(logits, target))


def window_means(losses, window: int, trailing: int, scored: list[int] | None = None) -> dict:
    """The mean loss of each window of ``scored`` (default every whole window), of the trailing positions,
    and of every position computed (``losses`` is NaN where none was)."""
    windows = losses[: losses.numel() // window * window].view(-1, window).mean(1)
    if scored is not None:
        windows = windows[scored]
    return {"windows": [round(float(w), 6) for w in windows], "trailing": round(float(losses[-trailing:].mean()), 6),
            "mean": round(float(losses.nanmean()), 6)}


# -- records ----------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict]:
    """The records written so far; a line a kill cut short is dropped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def drop_cut_line(path: Path) -> None:
    """Remove a last line a kill cut short, so that the next record starts a line of its own."""
    if path.is_file():
        text = path.read_text()
        if text and not text.endswith("\n"):
            path.write_text(text[: text.rfind("\n") + 1])


def append_record(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def record_key(record: dict) -> tuple:
    return (record["kind"], record["arm"], record.get("document"), record.get("length"), record.get("depth"),
            record.get("trial"))


def another_jobs(out: Path, settings: dict, overwrite: bool) -> bool:
    """Whether ``out`` holds the records of another job (to be replaced: ``overwrite``); UsageError when
    ``out`` is a file, or holds another job's records and ``overwrite`` is off. Writes nothing."""
    checks.output_folder("--out", out, overwrite=True)
    job_file = out / "job.json"
    if job_file.is_file() and json.loads(job_file.read_text()) != settings:
        if not overwrite:
            raise UsageError("--out", f"{out} holds the records of another context-eval",
                             "give another --out, or --overwrite true to start over")
        return True
    return False


def claim(out: Path, settings: dict, overwrite: bool) -> Path:
    """``out``'s records file, after checking that records there come from the same job."""
    job_file = out / "job.json"
    if another_jobs(out, settings, overwrite):
        (out / "records.jsonl").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(settings, indent=1))
    drop_cut_line(out / "records.jsonl")
    return out / "records.jsonl"


# -- summary ----------------------------------------------------------------------------------


def summarize(records: list[dict], arms: list[Arm], window: int, scored: list[int] | None = None) -> dict:
    """Per arm: each window's and the trailing mean over documents with intervals, the paired differences
    to full attention, and the retrieval grid's share answered per (length, depth). ``scored``: the indices
    of the windows the records hold (default: every window from the first)."""
    position = [r for r in records if r["kind"] == "position"]
    by_arm = {arm.name: {r["document"]: r for r in position if r["arm"] == arm.name} for arm in arms}
    documents = sorted(set.intersection(*(set(d) for d in by_arm.values()))) if by_arm else []
    if scored is None:
        scored = list(range(len(position[0]["windows"]))) if position else []
    summary = {"documents": documents, "window": window, "scored": scored, "arms": {}}
    for arm in arms:
        rows = [by_arm[arm.name][d] for d in documents]
        entry = {"label": arm.label()}
        if rows:
            entry["windows"] = [mean_interval([r["windows"][i] for r in rows]) for i in range(len(rows[0]["windows"]))]
            entry["trailing"] = mean_interval([r["trailing"] for r in rows])
        if rows and FULL in by_arm:
            pairs = list(zip(rows, [by_arm[FULL][d] for d in documents], strict=True))
            entry["windows_minus_full"] = [mean_interval([r["windows"][i] - f["windows"][i] for r, f in pairs])
                                           for i in range(len(rows[0]["windows"]))]
            entry["trailing_minus_full"] = mean_interval([r["trailing"] - f["trailing"] for r, f in pairs])
        entry["retrieval"] = retrieval_grid([r for r in records if r["kind"] == "retrieval" and r["arm"] == arm.name])
        summary["arms"][arm.name] = entry
    return summary


def retrieval_grid(records: list[dict]) -> list[dict]:
    cells: dict[tuple, list[bool]] = {}
    for r in records:
        cells.setdefault((r["length"], r["depth"]), []).append(r["answered"])
    return [{"length": length, "depth": depth, "answered": sum(v) / len(v), "trials": len(v)}
            for (length, depth), v in sorted(cells.items())]


# -- report -----------------------------------------------------------------------------------


def fmt_interval(entry: dict, signed: bool = False) -> str:
    sign = "+" if signed else ""
    if entry["low"] is None:
        return f"{entry['mean']:{sign}.3f}"
    return f"{entry['mean']:{sign}.3f} [{entry['low']:{sign}.3f}, {entry['high']:{sign}.3f}]"


def window_label(index: int, window: int) -> str:
    if window % 1024 == 0:
        return f"{index * window // 1024}–{(index + 1) * window // 1024}K"
    return f"{index * window}–{(index + 1) * window}"


def markdown(summary: dict, arms: list[Arm], job_line: str, machine: str, notes: list[str] = ()) -> str:
    window, n = summary["window"], len(summary["documents"])
    heads = [window_label(i, window) for i in summary["scored"]]
    lines = [f"# Loss by position and passkey retrieval, {n} held-out documents", "", f"`{job_line}`", "",
             f"Machine: {machine}.", "",
             *(line for note in notes for line in (f"{note[0].upper()}{note[1:]}", "")),
             "Loss (nats/token) per position window, mean over documents with 95% t interval:", "",
             "| arm | " + " | ".join(heads) + " | trailing |", "|---" * (len(heads) + 2) + "|"]
    for arm in arms:
        entry = summary["arms"][arm.name]
        if "windows" in entry:
            cells = [fmt_interval(w) for w in entry["windows"]] + [fmt_interval(entry["trailing"])]
            lines.append(f"| {arm.label()} | " + " | ".join(cells) + " |")
    lines += ["", "Difference to full attention (paired by document), 95% t interval:", "",
              "| arm | " + " | ".join(heads) + " | trailing |", "|---" * (len(heads) + 2) + "|"]
    for arm in arms:
        entry = summary["arms"][arm.name]
        if "windows_minus_full" in entry and arm.name != FULL:
            cells = [fmt_interval(w, True) for w in entry["windows_minus_full"]]
            cells.append(fmt_interval(entry["trailing_minus_full"], True))
            lines.append(f"| {arm.label()} | " + " | ".join(cells) + " |")
    grid = {arm.name: summary["arms"][arm.name]["retrieval"] for arm in arms}
    if any(grid.values()):
        lines += ["", "Passkey retrieval, share answered (length × depth; every arm the same keys):", ""]
        for arm in arms:
            cells = grid[arm.name]
            if cells:
                lines.append(f"- {arm.label()}: " + ", ".join(
                    f"{c['length']}@{c['depth']:.1f} {c['answered']:.2f}" for c in cells)
                    + f" (mean {sum(c['answered'] for c in cells) / len(cells):.2f})")
    return "\n".join(lines) + "\n"


# The MoBA paper's long-context panels read the loss at 14–16K and 20–22K of 32K: the same share of any length.
REFERENCE_WINDOWS = (("14–16K of 32K", 7 / 16, 8 / 16), ("20–22K of 32K", 10 / 16, 11 / 16))


def plot(summary: dict, arms: list[Arm], out: Path) -> None:
    window = summary["window"]
    fig = figures.figure(7, 7)
    top, bottom = fig.subplots(2, 1, sharex=True)
    seq_len = summary.get("settings", {}).get("seq_len")
    for i, (_, low, high) in enumerate(REFERENCE_WINDOWS if seq_len else ()):
        for axis in (top, bottom):
            axis.axvspan(low * seq_len, high * seq_len, color="grey", alpha=0.15, linewidth=0,
                         label="the reference figures' windows (14–16K, 20–22K of 32K)" if i == 0 and axis is top
                         else None)
    for arm in arms:
        entry = summary["arms"][arm.name]
        if "windows" not in entry:
            continue
        x = [(i + 0.5) * window for i in summary["scored"]]
        for axis, key in ((top, "windows"), (bottom, "windows_minus_full")):
            values = entry.get(key)
            if values is None:
                continue
            mean = [v["mean"] for v in values]
            axis.plot(x, mean, marker="o", label=arm.label())
            if values[0]["low"] is not None:
                axis.fill_between(x, [v["low"] for v in values], [v["high"] for v in values], alpha=0.2)
    top.set_ylabel("loss (nats/token)")
    top.set_title(f"loss by position, {len(summary['documents'])} held-out documents (95% t intervals)")
    top.legend(fontsize=8)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel("minus full attention")
    bottom.set_xlabel("position (tokens)")
    figures.save(fig, out / "windows.png")
    grids = [(arm, summary["arms"][arm.name]["retrieval"]) for arm in arms if summary["arms"][arm.name]["retrieval"]]
    if grids:
        plot_retrieval(grids, out / "retrieval.png")


def plot_retrieval(grids: list, path: Path) -> None:
    import numpy as np

    fig = figures.figure(3.2 * len(grids), 3.2)
    axes = fig.subplots(1, len(grids), squeeze=False)
    for axis, (arm, cells) in zip(axes[0], grids, strict=True):
        lengths = sorted({c["length"] for c in cells})
        depths = sorted({c["depth"] for c in cells})
        table = np.full((len(depths), len(lengths)), np.nan)
        for c in cells:
            table[depths.index(c["depth"]), lengths.index(c["length"])] = c["answered"]
        axis.imshow(table, vmin=0, vmax=1, cmap="RdYlGn", origin="lower", aspect="auto")
        axis.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        axis.set_yticks(range(len(depths)), [f"{d:.1f}" for d in depths])
        axis.set_title(arm.label(), fontsize=9)
        axis.set_xlabel("length")
    axes[0][0].set_ylabel("depth of the key")
    figures.save(fig, path)


# -- the job ----------------------------------------------------------------------------------


def work_items(job: ContextEvalJob, arms: list[Arm], documents, tokenizer) -> list[tuple[dict, callable]]:
    """``(record key fields, score(model) -> result fields)`` of every measurement, documents first."""
    items = []
    positions, scored = (None, None) if job.scored_windows is None else (job.positions(), job.scored())
    for name, ids in documents:
        for arm in arms:
            items.append(({"kind": "position", "arm": arm.name, "document": name}, lambda model, ids=ids: window_means(
                token_losses(model, ids, positions), job.window, job.trailing, scored)))
    import numpy as np

    rng = np.random.default_rng(0)
    for length in job.retrieval_lengths:
        for depth in job.retrieval_depths:
            for trial in range(job.retrieval_trials):
                prompt, answer = passkey_prompt(tokenizer, length, depth, int(rng.integers(10_000, 100_000)))
                for arm in arms:
                    items.append(({"kind": "retrieval", "arm": arm.name, "length": length, "depth": depth,
                                   "trial": trial}, lambda model, p=prompt, a=answer: dict(zip(
                                       ("answered", "key_loss"), answers(model, p, a), strict=True))))
    return items


def check_job(job: ContextEvalJob, checkpoint: dict) -> list[Arm]:
    import torch

    from flexmoba.checkpoint import checkpoint_config

    try:
        device = torch.device(job.device)
    except RuntimeError:
        raise UsageError("--device", f"{job.device!r} is not a device", "give cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", "no CUDA device is available here", "give --device cpu")
    arms = [Arm.parse(a) for a in job.arms]
    if not arms:
        raise UsageError("--arms", "no arm given", "give e.g. [full, moba:512:3]")
    context = checkpoint_config(checkpoint).max_seq_len
    for option, value in (("--seq_len", job.seq_len), *(("--retrieval_lengths", n) for n in job.retrieval_lengths)):
        if context is not None and value > context:
            raise UsageError(option, f"{value} tokens exceed the model's context of {context}",
                             f"give at most {context}")
    if job.seq_len % job.window:
        raise UsageError("--window", f"seq_len {job.seq_len} must be a multiple of window {job.window}",
                         "give a window that divides --seq_len")
    windows = job.seq_len // job.window
    if job.scored_windows is not None and (not job.scored_windows or len(set(job.scored_windows)) != len(
            job.scored_windows) or not all(0 <= i < windows for i in job.scored_windows)):
        raise UsageError("--scored_windows", f"{job.scored_windows} must be distinct window indices in [0, "
                         f"{windows})", f"give e.g. [0, {windows - 1}] (window i covers positions i * {job.window} "
                         f"to (i + 1) * {job.window}), or leave it out for all {windows}")
    if job.trailing > job.seq_len:
        raise UsageError("--trailing", f"{job.trailing} positions exceed --seq_len {job.seq_len}",
                         f"give at most {job.seq_len}")
    return arms


SPLITS = ("train", "val", "test")


def check_values(job: ContextEvalJob) -> None:
    """Each option's value on its own, before anything is read (with the checkpoint: :func:`check_job`)."""
    counts = (("--seq_len", job.seq_len, "the tokens scored per document, e.g. 8192"),
              ("--documents", job.documents, "the documents scored per arm, e.g. 20"),
              ("--window", job.window, "the width of the position windows, e.g. 1024"),
              ("--trailing", job.trailing, "the last positions reported on their own, e.g. 256"),
              ("--retrieval_trials", job.retrieval_trials, "keys per (length, depth) cell, e.g. 2; "
               "--retrieval_lengths [] for no retrieval"),
              ("--threads", job.threads, "the torch threads, or leave it out for torch's default"))
    for option, value, what in counts:
        if value is not None and value <= 0:
            raise UsageError(option, f"must be a positive int, got {value}", f"give {what}")
    for length in job.retrieval_lengths:
        if length <= 0:
            raise UsageError("--retrieval_lengths", f"must be positive ints, got {length}",
                             "give prompt lengths in tokens, e.g. [4096, 8192], or [] for no retrieval")
    for depth in job.retrieval_depths:
        if not 0 <= depth <= 1:
            raise UsageError("--retrieval_depths", f"{depth} is not a share of the filler",
                             "give depths in [0, 1], e.g. [0.1, 0.5, 0.9]")
    if job.retrieval_lengths and not job.retrieval_depths:
        raise UsageError("--retrieval_depths", "empty, while --retrieval_lengths asks for retrieval",
                         "give depths in [0, 1], e.g. [0.5], or --retrieval_lengths [] for no retrieval")
    if job.root is not None and not Path(job.root).is_dir():
        problem = "is a file, not a folder" if Path(job.root).exists() else "does not exist"
        raise UsageError("--root", f"{job.root} {problem}", "give the corpus folder, or leave it out for this "
                         "Python's standard library")
    if not job.patterns:
        raise UsageError("--patterns", "empty: no file would be read", "give file globs, e.g. ['*.py']")
    if job.split not in SPLITS:
        raise UsageError("--split", f"{job.split!r} is not a split", "give train, val or test")
    for option, value in (("--val_fraction", job.val_fraction), ("--test_fraction", job.test_fraction)):
        if not 0 <= value < 1:
            raise UsageError(option, f"must be in [0, 1), got {value}", "give the training data's (the "
                             "split is by path hash)")
    if job.val_fraction + job.test_fraction >= 1:
        raise UsageError("--test_fraction", f"val_fraction {job.val_fraction} + test_fraction {job.test_fraction} "
                         "must be below 1", "give the training data's fractions")


def run(job: ContextEvalJob) -> dict:
    import torch

    from flexmoba.checkpoint import checkpoint_config, load_model

    check_values(job)
    checkpoint = checks.checkpoint_file("--ckpt", job.ckpt)
    arms = check_job(job, checkpoint)
    tokenizer = load_tokenizer(job, checkpoint)  # before the arms' fit: a byte-level model's real problem
    configs = {arm.name: arm.config(checkpoint_config(checkpoint)) for arm in arms}  # before any model is built
    notes = dense_notes(arms, configs, job.seq_len) + sliding_notes(checkpoint_config(checkpoint))
    for note in notes:
        sys.stderr.write(f"flexmoba: {note}\n")
    sys.stderr.flush()
    if job.threads:
        torch.set_num_threads(job.threads)
    out = Path(job.out)
    another_jobs(out, job.settings(), job.overwrite)
    documents = held_out_documents(job, tokenizer)
    measurements = work_items(job, arms, documents, tokenizer)  # a prompt too short for the needle: refused here
    records_path = claim(out, job.settings(), job.overwrite)  # the first write: every check is behind
    models = {arm.name: load_model(checkpoint, job.device, **arm.overrides()) for arm in arms}
    done = {record_key(r) for r in read_records(records_path)}
    items = [(key, score) for key, score in measurements if record_key(key) not in done]
    print(f"context-eval: {len(documents)} documents of the {job.split} split, {len(arms)} arms, "
          f"{len(items)} measurements to go ({len(done)} done before) into {out}", flush=True)
    started = time.monotonic()
    for i, (key, score) in enumerate(items, 1):
        name = f"[{i}/{len(items)}] {key['kind']} {key['arm']} {measured(key)}"
        with Ticker(progress_seconds(), running(name, time.monotonic()), lambda line: print(line, flush=True)):
            append_record(records_path, {**key, **score(models[key["arm"]])})
        elapsed = time.monotonic() - started
        print(f"{name} {elapsed:.0f}s elapsed, about {elapsed / i * (len(items) - i):.0f}s left", flush=True)
    return report(job, arms, read_records(records_path), out, notes)


def running(name: str, began: float):
    """The line said while measurement ``name``, begun at ``began``, runs past the progress interval."""
    return lambda: f"{name} running for {time.monotonic() - began:.0f}s"


def measured(key: dict) -> str:
    """What a measurement scores: its document, or its passkey's length and depth."""
    return key.get("document") or f"{key.get('length')}@{key.get('depth')}"


def dense_notes(arms: list[Arm], configs: dict, seq_len: int) -> list[str]:
    """``note: <arm>: ...`` for each arm whose MoBA cannot be sparse at ``seq_len`` (every earlier key in a
    selected chunk: the arm's row is full attention's, a difference of +0.000;
    :func:`lit.training.progress.moba_note`)."""
    from lit.training.progress import moba_note

    notes = []
    for arm in arms:
        note = moba_note(configs[arm.name], seq_len)
        if note:
            notes.append(f"note: {arm.name}: {note.removeprefix('note: ')}")
    return notes


def sliding_notes(config) -> list[str]:
    """``note: ...`` naming the layers an arm changes, when the model has sliding-window layers (they keep
    their window in every arm)."""
    types = config.types()
    if "sliding" not in types:
        return []
    global_layers = [i for i, kind in enumerate(types) if kind == "global"]
    return [f"note: the arms differ in the {len(global_layers)} global layers only (layers "
            f"{', '.join(map(str, global_layers))} of {len(types)}); the {len(types) - len(global_layers)} "
            f"sliding-window layers keep their {config.sliding_window}-token window in every arm"]


def machine_name(device: str = "cpu") -> str:
    import torch

    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                return f"{name}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    except OSError:
        pass
    return f"torch {torch.__version__}"


def report(job: ContextEvalJob, arms: list[Arm], records: list[dict], out: Path, notes: list[str] = ()) -> dict:
    summary = summarize(records, arms, job.window, job.scored())
    summary["settings"] = job.settings()
    summary["notes"] = list(notes)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    line = "flexmoba context-eval " + " ".join(sys.argv[1:])
    (out / "results.md").write_text(markdown(summary, arms, line, machine_name(job.device), notes))
    plot(summary, arms, out)
    return summary


def main(argv: list[str] | None = None) -> dict:
    job = parse_dataclass(ContextEvalJob, argv, prog="flexmoba context-eval", description=__doc__)
    summary = run(job)
    trailing = {name: entry["trailing"] for name, entry in summary["arms"].items() if "trailing" in entry}
    print(f"context-eval: {len(summary['documents'])} documents; trailing loss: "
          + ", ".join(f"{name} {fmt_interval(v)}" for name, v in trailing.items()) + f"; see {job.out}")
    return summary
