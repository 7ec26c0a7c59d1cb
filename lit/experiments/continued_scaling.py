"""Continued-training scaling of MoBA against full attention, from a pretrained checkpoint.

    flexmoba continued-scaling --config configs/pretrained/smollm2_scaling.yaml --out ~/flexmoba-runs/smollm2-scaling
    flexmoba continued-scaling --config ... --budgets '[15, 30, 60, 120]' --arms '[full, moba:512:3, moba:512:3:3]'

From the weights of ``--model.init_from`` every arm (``full``; ``moba:CHUNK:TOPK``, MoBA in every layer;
``moba:CHUNK:TOPK:N``, the last N layers full, as ``flexmoba context-eval`` spells them) trains at each
budget of ``--budgets`` optimizer steps, and every budget's model is scored by ``flexmoba context-eval``
on the same held-out documents (the test split of the training data, so never trained on), paired
across arms and budgets; the pretrained weights are scored too (budget 0, training-free).

One warmup-stable-decay trunk per arm (warmup, then a constant lr) branches once per budget: the trunk
trains to ``(1 - decay_fraction) * budget`` steps, the branch resumes from there and decays the lr
linearly to ``min_lr_ratio * lr`` at ``budget``, so every budget is an annealed model and the trunk is
trained once. Budgets go in ascending order, every arm at a budget before the next budget.

Everything lands in ``--out`` as it finishes: ``<arm>/trunk`` and ``<arm>/b<budget>`` (Lightning runs,
resumed from their last checkpoint when killed), ``<arm>/b<budget>/eval`` (context-eval's records), and
``study.jsonl``, one record per finished part with its wall time (``running.json`` keeps the running part's
seconds, so a part killed and resumed counts both runs). Started again with the same arguments
it goes on where it stopped, after a line with the estimated wall time of what remains (from the step
and evaluation times measured so far); an ``--out`` holding a study with other settings is refused.
``flexmoba continued-scaling-report`` turns the records into tables and figures
(:mod:`lit.experiments.continued_scaling_report`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from flexmoba.model import ModelConfig
from lit.experiments.context_eval import Arm, ContextEvalJob
from lit.training.data import DEFAULT_PATTERNS
from lit.training.errors import UsageError
from lit.training.guards import newest_intact_checkpoint
from lit.training.launch import read_config, run_cli, saved_step
from lit.training.ticker import Ticker

PROG = "flexmoba continued-scaling"
STUDY_KEYS = ("out", "arms", "budgets", "decay_fraction", "eval_seq_len", "eval_documents", "eval_window",
              "eval_trailing", "retrieval_lengths", "retrieval_depths", "retrieval_trials", "eval_device")
NOT_SETTINGS = ("eval_device",)  # where the study runs, not what it measures: a resume may change it
# context-eval scores; the fits validate nothing
DEFAULTS = {"trainer.limit_val_batches": 0, "trainer.num_sanity_val_steps": 0, "trainer.enable_model_summary": False}


def study_arguments(parser) -> None:
    parser.add_argument("--out", type=str, default="runs/continued-scaling", help="the study's folder")
    parser.add_argument("--arms", type=list[str], default=["full", "moba:512:3", "moba:512:3:3"],
                        help="full, moba:CHUNK:TOPK, moba:CHUNK:TOPK:N (the last N layers full)")
    parser.add_argument("--budgets", type=list[int], default=[15, 30, 60, 120],
                        help="optimizer steps of continued training, ascending; each an annealed model")
    parser.add_argument("--decay_fraction", type=float, default=0.2, help="share of a budget spent decaying the lr")
    parser.add_argument("--eval_seq_len", type=int, default=8192, help="tokens scored per held-out document")
    parser.add_argument("--eval_documents", type=int, default=20, help="held-out documents scored per model")
    parser.add_argument("--eval_window", type=int, default=512, help="width of the scored position windows")
    parser.add_argument("--eval_trailing", type=int, default=256, help="the last positions, scored on their own")
    parser.add_argument("--retrieval_lengths", type=list[int], default=[4096, 8192],
                        help="passkey lengths, scored at budget 0 and the largest budget")
    parser.add_argument("--retrieval_depths", type=list[float], default=[0.1, 0.5, 0.9], help="passkey depths")
    parser.add_argument("--retrieval_trials", type=int, default=2, help="keys per (length, depth) cell")
    parser.add_argument("--eval_device", type=str, default="cpu", help="where the evaluations run (cpu, cuda)")


def complete(config) -> None:
    """The study's own options checked, one line naming the option, before anything is read or trained."""
    arms = [Arm.parse(a) for a in config.arms]
    if not arms or len({a.name for a in arms}) != len(arms):
        raise UsageError("--arms", f"give distinct arms, got {config.arms}")
    budgets = config.budgets
    if not budgets or any(b < 1 for b in budgets) or sorted(set(budgets)) != list(budgets):
        raise UsageError("--budgets", f"must be distinct positive step counts in ascending order, got {budgets}")
    if not 0 < config.decay_fraction < 1:
        raise UsageError("--decay_fraction", f"must be between 0 and 1, got {config.decay_fraction}")
    for budget in budgets:
        if not 1 <= branch_point(budget, config.decay_fraction) < budget:
            raise UsageError("--budgets", f"{budget} steps cannot hold both a stable phase and a decay of "
                             f"{config.decay_fraction:.0%}", "give larger budgets")
    for name in ("eval_seq_len", "eval_documents", "eval_window", "eval_trailing", "retrieval_trials"):
        if config[name] < 1:
            raise UsageError(f"--{name}", f"must be a positive int, got {config[name]}")
    if config.eval_seq_len % config.eval_window:
        raise UsageError("--eval_window", f"{config.eval_window} does not divide --eval_seq_len {config.eval_seq_len}")
    if config.model.init_from is None:
        raise UsageError("--model.init_from", "continued training needs the pretrained checkpoint to start from",
                         "give the flexmoba checkpoint of flexmoba import-hf")
    fields = config.model.config.as_dict() if hasattr(config.model.config, "as_dict") else config.model.config
    for arm in arms:
        try:
            ModelConfig(**arm_model_fields(dict(fields or {}), arm))
        except (TypeError, ValueError) as error:
            raise UsageError("--arms", f"{arm.name} does not fit the model: {error}") from None
    config.model.wsd_decay_steps = 0  # each part sets its own


def parse(argv: list[str]) -> dict:
    return read_config(argv, study_arguments, DEFAULTS, complete, prog=PROG, description=__doc__)


def branch_point(budget: int, decay_fraction: float) -> int:
    """The trunk step a budget's branch starts decaying from."""
    return round(budget * (1 - decay_fraction))


def arm_folder(study: dict, arm: Arm) -> Path:
    return Path(study["out"]) / arm.name.replace(":", "_")


def fit_config(study: dict, arm: Arm, folder: Path, steps: int, decay_steps: int) -> dict:
    """The ``flexmoba fit`` config of one part of the study: ``arm``'s attention, ``steps`` in all, the lr
    decaying over the last ``decay_steps`` of them."""
    config = json.loads(json.dumps({k: v for k, v in study.items() if k not in STUDY_KEYS}))
    model = config["model"]
    model["config"] = arm_model_fields(model["config"], arm)
    model["wsd_decay_steps"] = decay_steps
    config["trainer"]["max_steps"] = steps
    config["trainer"]["default_root_dir"] = str(folder)
    return config


def arm_model_fields(fields: dict, arm: Arm) -> dict:
    """``ModelConfig`` fields (a dict) made to attend as ``arm``, the rest unchanged."""
    overrides = arm.overrides()
    merged = {**fields, **{k: v for k, v in overrides.items() if k != "moba"}}
    if "moba" in overrides:
        merged["moba"] = {**(fields.get("moba") or {}), **overrides["moba"]}
    return merged


def train(study: dict, arm: Arm, folder: Path, steps: int, decay_steps: int) -> None:
    """Fit one part to ``steps``, resuming from the newest checkpoint of ``folder`` if there is one."""
    config = fit_config(study, arm, folder, steps, decay_steps)
    if any((folder / "checkpoints").glob("*.ckpt")):
        config["ckpt_path"] = "last"
    cli = run_cli({"fit": config})
    if saved_step(folder / "checkpoints")[1] != steps:
        # a resumed fit saves no last checkpoint at a final step its checkpoint interval does not divide
        cli.trainer.save_checkpoint(folder / "checkpoints" / "last.ckpt")


def start_branch(trunk: Path, branch: Path, step: int) -> None:
    """Give ``branch`` the trunk's checkpoint at ``step`` to resume from, as ``branch_start.ckpt`` (a hard
    link when it can: the trunk replaces its last.ckpt by a new file, never in place). Its time is the
    trunk's, so every checkpoint the branch writes is newer."""
    if any((branch / "checkpoints").glob("*.ckpt")):
        return
    source = trunk / "checkpoints" / "last.ckpt"
    at = saved_step(trunk / "checkpoints")[1]
    if at != step:
        raise RuntimeError(f"{trunk} is at step {at}, not at the branch point {step}")
    (branch / "checkpoints").mkdir(parents=True, exist_ok=True)
    target = branch / "checkpoints" / "branch_start.ckpt"
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def eval_job(study: dict, arm: Arm, ckpt: str, out: Path, retrieval: bool) -> ContextEvalJob:
    data = study["data"]["init_args"]
    return ContextEvalJob(
        ckpt=ckpt, out=str(out), arms=[arm.name], seq_len=study["eval_seq_len"], documents=study["eval_documents"],
        window=study["eval_window"], trailing=study["eval_trailing"], root=data.get("root"),
        patterns=list(data.get("patterns") or DEFAULT_PATTERNS), split="test", val_fraction=data["val_fraction"],
        test_fraction=data["test_fraction"], tokenizer=data.get("tokenizer"),
        retrieval_lengths=list(study["retrieval_lengths"]) if retrieval else [],
        retrieval_depths=list(study["retrieval_depths"]), retrieval_trials=study["retrieval_trials"],
        device=study.get("eval_device", "cpu"))


def evaluate(study: dict, arm: Arm, ckpt: str, out: Path, retrieval: bool) -> None:
    from lit.experiments import context_eval

    context_eval.run(eval_job(study, arm, ckpt, out, retrieval))


# -- the plan ---------------------------------------------------------------------------------


def plan(study: dict) -> list[dict]:
    """Every part of the study in the order it runs: ``{"part", "arm", "budget", ...}``; a trunk part trains
    its arm's trunk up to ``steps``, a branch part decays over its last ``steps``."""
    arms = [Arm.parse(a) for a in study["arms"]]
    largest = study["budgets"][-1]
    parts = [{"part": "eval", "arm": arm.name, "budget": 0, "retrieval": True} for arm in arms]
    for budget in study["budgets"]:
        point = branch_point(budget, study["decay_fraction"])
        for arm in arms:
            parts += [{"part": "trunk", "arm": arm.name, "budget": budget, "steps": point},
                      {"part": "branch", "arm": arm.name, "budget": budget, "steps": budget - point},
                      {"part": "eval", "arm": arm.name, "budget": budget, "retrieval": budget == largest}]
    return parts


def part_key(part: dict) -> tuple:
    return part["part"], part["arm"], part["budget"]


def run_part(study: dict, part: dict) -> None:
    arm = Arm.parse(part["arm"])
    folder = arm_folder(study, arm)
    budget = part["budget"]
    if part["part"] == "trunk":
        train(study, arm, folder / "trunk", part["steps"], 0)
    elif part["part"] == "branch":
        point = branch_point(budget, study["decay_fraction"])
        start_branch(folder / "trunk", folder / f"b{budget}", point)
        train(study, arm, folder / f"b{budget}", budget, budget - point)
    else:
        ckpt = study["model"]["init_from"] if budget == 0 else trained_checkpoint(folder / f"b{budget}", budget)
        evaluate(study, arm, ckpt, folder / f"b{budget}" / "eval", part["retrieval"])
        if budget:
            keep_only(Path(ckpt))


def keep_only(ckpt: Path) -> None:
    """Delete the other checkpoints of a scored branch (its start and interval copies): 1.6 GB each at
    SmolLM2's size, three per branch otherwise."""
    for path in ckpt.parent.glob("*.ckpt"):
        if path != ckpt:
            path.unlink()


def trained_checkpoint(run: Path, budget: int) -> str:
    """The newest checkpoint of a finished branch, which must be at its budget."""
    newest, _ = newest_intact_checkpoint(run / "checkpoints")
    step = saved_step(run / "checkpoints")[1]
    if newest is None or step != budget:
        raise RuntimeError(f"{run} holds no checkpoint at step {budget} (newest: {newest}, step {step})")
    return str(newest)


def trunk_step(study: dict, arm: str) -> int:
    """The step ``arm``'s trunk is at on disk: 0 before it starts, or where its checkpoints are gone (the study
    moved to another machine with only its records)."""
    return saved_step(arm_folder(study, Arm.parse(arm)) / "trunk" / "checkpoints")[1] or 0


def part_start(study: dict, part: dict, records: list[dict]) -> int:
    """The trunk step a trunk part trains from: where a killed run of it started, else the lower of the arm's
    recorded trunk steps and its checkpoints'."""
    earlier = running_part(Path(study["out"]), part)
    if "from_step" in earlier:
        return int(earlier["from_step"])
    recorded = max((r["steps_total"] for r in records if r["part"] == "trunk" and r["arm"] == part["arm"]), default=0)
    return min(recorded, trunk_step(study, part["arm"]))


def steps_to_train(study: dict, parts: list[dict], records: list[dict]) -> list[int]:
    """The steps each of ``parts`` still has to run (0 for an evaluation): each arm's first trunk part from
    :func:`part_start`, its later ones from where the one before ends."""
    at, steps = {}, []
    for part in parts:
        if part["part"] == "trunk":
            start = at[part["arm"]] if part["arm"] in at else part_start(study, part, records)
            steps.append(max(0, part["steps"] - start))
            at[part["arm"]] = max(start, part["steps"])
        else:
            steps.append(part["steps"] if part["part"] == "branch" else 0)
    return steps


def evaluations(parts: list[dict]) -> int:
    return sum(part["part"] == "eval" for part in parts)


def remaining_estimate(steps: int, evals: int, records: list[dict]) -> str:
    """``about 3.2 h (41 steps at 57 s, 4 evaluations at 420 s)`` from the times measured so far."""
    trained = [r for r in records if r["part"] != "eval" and r["steps"]]
    scored = [r for r in records if r["part"] == "eval"]
    step_s = sum(r["seconds"] for r in trained) / sum(r["steps"] for r in trained) if trained else None
    eval_s = sum(r["seconds"] for r in scored) / len(scored) if scored else None
    if step_s is None or eval_s is None:
        return f"{steps} steps and {evals} evaluations (no time measured yet for " \
               f"{'steps' if step_s is None else 'evaluations'})"
    total = steps * step_s + evals * eval_s
    return f"about {total / 3600:.1f} h ({steps} steps at {step_s:.0f} s, {evals} evaluations at {eval_s:.0f} s)"


# -- records ----------------------------------------------------------------------------------


def with_new_model_fields(settings: dict) -> dict:
    """Recorded settings with the :class:`ModelConfig` fields added since they were recorded, at their
    defaults (which build the model the study trained), so that a newer flexmoba resumes the study."""
    config = settings.get("model", {}).get("config")
    if isinstance(config, dict):
        defaults = json.loads(json.dumps(dataclasses.asdict(ModelConfig())))
        config.update({k: v for k, v in defaults.items() if k not in config})
    return settings


def compared(settings: dict) -> dict:
    """The settings two runs of one study must share: without ``checkpoint.dirpath``, which follows the
    working directory (each part puts its checkpoints under its own folder), so a study resumes from anywhere."""
    checkpoint = {k: v for k, v in settings.get("checkpoint", {}).items() if k != "dirpath"}
    return {**settings, "checkpoint": checkpoint}


def claim(study: dict) -> Path:
    """``<out>/study.jsonl``, after recording the settings in ``<out>/study.json`` or checking them."""
    out = Path(study["out"])
    settings = out / "study.json"
    recorded = json.loads(json.dumps({k: v for k, v in study.items() if k not in NOT_SETTINGS}))
    if settings.is_file():
        if compared(with_new_model_fields(json.loads(settings.read_text()))) != compared(recorded):
            raise UsageError("--out", f"{out} holds a continued-scaling study with other settings",
                             "give another --out, or the same arguments to resume it")
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UsageError("--out", f"{out} exists and is not a continued-scaling study's folder",
                             "give another --out")
        out.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(recorded, indent=1))
    from lit.experiments.context_eval import drop_cut_line

    drop_cut_line(out / "study.jsonl")
    return out / "study.jsonl"


RUNNING = "running.json"  # the part running and its seconds so far: a killed part's time is not lost
CLOCK_SECONDS = 30.0


def running_part(out: Path, part: dict) -> dict:
    """What an earlier run of the study, killed during ``part``, left of it: ``{"seconds", "from_step"}``
    (empty for a part begun now)."""
    try:
        running = json.loads((out / RUNNING).read_text())
        return running if running["part"] == list(part_key(part)) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def seconds_before(out: Path, part: dict) -> float:
    """The seconds ``part`` ran in earlier runs of the study, killed during it (0 for a part begun now)."""
    try:
        return float(running_part(out, part).get("seconds", 0.0))
    except (TypeError, ValueError):
        return 0.0


def note_running(out: Path, part: dict, seconds: float, from_step: int | None = None) -> None:
    written = out / f"{RUNNING}.tmp"
    running = {"part": list(part_key(part)), "seconds": round(seconds, 1)}
    if from_step is not None:
        running["from_step"] = from_step
    written.write_text(json.dumps(running))
    written.replace(out / RUNNING)


def timed_part(study: dict, part: dict, from_step: int | None = None) -> float:
    """Run ``part`` (a trunk part from trunk step ``from_step``); the seconds it took, those of earlier runs
    killed during it included."""
    out = Path(study["out"])
    before, started = seconds_before(out, part), time.monotonic()

    def clock() -> float:
        return before + time.monotonic() - started

    # the ticker's line says nothing: it keeps the part's seconds on disk for a run killed during it
    with Ticker(CLOCK_SECONDS, lambda: note_running(out, part, clock(), from_step), lambda line: None):
        run_part(study, part)
    return clock()


def run(study: dict) -> Path:
    from lit.experiments.context_eval import append_record, machine_name, read_records

    records_path = claim(study)
    records = read_records(records_path)
    done = {part_key(r) for r in records}
    parts = [p for p in plan(study) if part_key(p) not in done]
    steps = steps_to_train(study, parts, records)
    print(f"[continued-scaling] {len(done)} parts done, {len(parts)} to go into {study['out']}; remaining: "
          f"{remaining_estimate(sum(steps), evaluations(parts), records)}", flush=True)
    for i, part in enumerate(parts, 1):
        print(f"[continued-scaling] part {i}/{len(parts)}: {part['part']} {part['arm']} budget {part['budget']}",
              flush=True)
        start = part["steps"] - steps[i - 1] if part["part"] == "trunk" else None
        record = {**part, "seconds": round(timed_part(study, part, start), 1), "steps": steps[i - 1],
                  "machine": machine_name()}
        if part["part"] == "trunk":
            record["steps_total"] = part["steps"]
        append_record(records_path, record)
        records.append(record)
        print(f"[continued-scaling] done in {record['seconds']:.0f} s; remaining: "
              f"{remaining_estimate(sum(steps[i:]), evaluations(parts[i:]), records)}", flush=True)
    return Path(study["out"])


def training_flops_per_token(study: dict, arm: Arm) -> float:
    """``6 N`` plus the attention a training step really computes, per token, at the training length."""
    fields = arm_model_fields(study["model"]["config"], arm)
    return ModelConfig(**fields).flops_per_token(study["data"]["init_args"]["seq_len"])


def main(argv: list[str] | None = None) -> Path:
    import sys

    study = parse(sys.argv[1:] if argv is None else list(argv))
    out = run(study)
    print(f"flexmoba: continued-scaling done: records in {out / 'study.jsonl'}; report with "
          f"flexmoba continued-scaling-report --study {out}", flush=True)
    return out
