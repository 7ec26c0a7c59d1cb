"""Scaling-law sweep: MoBA vs full attention over model sizes, one Lightning run each.

    flexmoba sweep configs/sweep/toy.yaml                 # run (or resume) the sweep, then report
    flexmoba sweep configs/sweep/toy.yaml --report_only

Every (model size, attention type[, seed]) is an ordinary ``flexmoba fit`` run in its own
folder ``<out_dir>/<size>-<attention>/`` (``<size>-<attention>-seed<n>/`` when the sweep
lists ``seeds``), trained on ``tokens_per_parameter`` tokens per
non-embedding parameter (a Chinchilla-style rule), then validated once. A finished run
leaves ``result.json`` and is skipped on re-run; an interrupted one resumes from its
``checkpoints/last.ckpt``. The report (:mod:`lit.experiments.scaling_report`) fits ``L = a · C^b`` per
attention type and position window. ``--plan`` lists the runs with their steps, compute
and, given the ``step_seconds`` measured on this machine, the estimated wall time.

Under ``torchrun`` (one process per device, on one node or many) every run is one DDP job
over all processes:

    torchrun --nproc-per-node 2 -m lit.cli.main sweep configs/sweep/toy.yaml

Rank 0 alone decides which runs to start, resume or skip (every rank then follows its
plan) and alone writes results and the report. ``batch_size`` is the global batch, split
evenly over the processes, so a sweep gives the same runs on any number of processes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from lit.experiments.scaling_law import pflops_days
from lit.training.errors import UsageError
from lit.training.options import OneLineArgumentParser

RUN_OVERHEAD_SECONDS = 15.0  # starting Lightning, mapping the corpus, writing checkpoints: per run, in --plan
# Gate diagnostics compute full attention's probabilities: measured 55 s per layer for one 32K sequence
# on 2 CPU cores (8 GB peak), quadratic in the sequence length.
GATE_SECONDS_PER_LAYER_32K = 55.0


@dataclass
class ModelSize:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int | None = None


@dataclass
class AttentionKind:
    """One attention type of a sweep: ModelConfig fields, plus where and how it is trained.

    Attributes:
        name: the type's name in run folders, e.g. ``moba``.
        model: ModelConfig fields, e.g. ``{attention: moba, moba_chunk_size: 512, moba_top_k: 3}``.
        sizes: the model sizes trained with it; default: all.
        switch_to_full_at: train with ``model`` for this fraction of the steps, then with full
            attention in every layer (:class:`lit.training.callbacks.AttentionPhaseSwitch`); default: never.
    """

    name: str
    model: dict
    sizes: list[str] | None = None
    switch_to_full_at: float | None = None

    RUN_KEYS = ("sizes", "switch_to_full_at")

    @classmethod
    def parse(cls, name: str, entry: dict) -> AttentionKind:
        model = {k: v for k, v in entry.items() if k not in cls.RUN_KEYS}
        return cls(name, model, entry.get("sizes"), entry.get("switch_to_full_at"))

    def trains(self, size: ModelSize) -> bool:
        return self.sizes is None or size.name in self.sizes

    def full_share(self) -> float:
        """Share of the steps trained with full attention in every layer."""
        return 0.0 if self.switch_to_full_at is None else 1.0 - self.switch_to_full_at


@dataclass
class SweepSpec:
    """A sweep, as read from YAML (every key below; unknown keys are an error).

    Attributes:
        out_dir: folder of the sweep; one sub-folder per run.
        sizes: model sizes (at least 2 for a fit; the paper's figures use 5).
        attention: name -> ModelConfig fields of that attention type, e.g.
            ``{moba: {attention: moba, moba_chunk_size: 256, moba_top_k: 3}, full: {attention: full}}``;
            an entry may also restrict itself to some sizes and switch to full attention late
            (see :class:`AttentionKind`), e.g. ``hybrid: {attention: moba, ..., sizes: [s3, s4],
            switch_to_full_at: 0.9}``.
        seeds: seeds of every (size, attention) pair, each its own run (model initialisation and
            data order); default: one run, seeded by the base config, named without a seed.
        extra_seeds: size name -> seeds run for that size besides ``seeds``, by every attention
            that trains it (e.g. ``{s4: [2]}``: a third seed at the largest size).
        seq_len, batch_size: training sequences.
        tokens_per_parameter: training tokens per non-embedding parameter.
        min_steps: floor on the optimizer steps of the smallest runs.
        position_window, trailing_window: widths of the evaluated position windows.
        lr: AdamW peak learning rate; default the module's (:class:`lit.training.module.LitLM`).
        warmup_fraction: warmup share of the steps.
        limit_val_batches: validation batches of the final evaluation.
        base_config: the Lightning CLI YAML every run starts from.
        cli_args: extra CLI arguments for every run (e.g. ``--trainer.accelerator gpu``).
        gate_diagnostics: run names (e.g. ``s4-moba-seed0``) trained with
            :class:`lit.experiments.gate_diagnostics.GateDiagnostics` (its figure goes into the report).
        report_dir: a folder the report is copied into besides ``out_dir`` (e.g. under docs/).
        step_seconds: measured seconds of one training step, per ModelConfig ``attention``
            (``moba``, ``full``), as ``[[non-embedding parameters, seconds], ...]`` at this
            sweep's ``seq_len`` and ``batch_size``; ``--plan`` interpolates them (log-log).
    """

    out_dir: str
    sizes: list[ModelSize]
    attention: dict[str, dict]
    seq_len: int = 2048
    batch_size: int = 8
    tokens_per_parameter: float = 20.0
    min_steps: int = 20
    position_window: int = 256
    trailing_window: int = 256
    lr: float | None = None
    warmup_fraction: float = 0.05
    limit_val_batches: int = 16
    base_config: str = "configs/moba.yaml"
    cli_args: list[str] = field(default_factory=list)
    seeds: list[int] | None = None
    extra_seeds: dict[str, list[int]] = field(default_factory=dict)
    gate_diagnostics: list[str] = field(default_factory=list)
    report_dir: str | None = None
    step_seconds: dict[str, list[list[float]]] = field(default_factory=dict)

    @classmethod
    def from_yaml(cls, path: str | Path) -> SweepSpec:
        raw = yaml.safe_load(Path(path).read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"sweep config {path} must be a mapping")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown keys in sweep config {path}: {sorted(unknown)}")
        sizes = raw.pop("sizes", None)
        if not sizes:
            raise ValueError(f"sweep config {path}: 'sizes' must list at least one model size")
        if not raw.get("attention"):
            raise ValueError(f"sweep config {path}: 'attention' must name at least one attention type")
        spec = cls(sizes=[ModelSize(**s) for s in sizes], **raw)
        spec.check(path)
        return spec

    def check(self, path: str | Path) -> None:
        """ValueError naming the key, for settings that name sizes or runs that do not exist."""
        size_names = {s.name for s in self.sizes}
        for kind in self.attention_kinds():
            unknown = set(kind.sizes or ()) - size_names
            if unknown:
                raise ValueError(f"sweep config {path}: attention {kind.name!r} names unknown sizes {sorted(unknown)}")
            if kind.switch_to_full_at is not None and not 0 <= kind.switch_to_full_at <= 1:
                raise ValueError(f"sweep config {path}: attention {kind.name!r}: switch_to_full_at must be in [0, 1]")
        for size, seeds in self.extra_seeds.items():
            if size not in size_names:
                raise ValueError(f"sweep config {path}: extra_seeds names unknown size {size!r}")
            if not self.seeds or set(seeds) & set(self.seeds):
                raise ValueError(f"sweep config {path}: extra_seeds of {size!r} must add seeds to a sweep "
                                 f"with seeds, none of {self.seeds}")
        run_names = {run.name for run in self.runs()}
        unknown = set(self.gate_diagnostics) - run_names
        if unknown:
            raise ValueError(f"sweep config {path}: gate_diagnostics names unknown runs {sorted(unknown)}")
        for run in self.runs():
            run.model_config()  # validates every size x attention combination up front

    def attention_kinds(self) -> list[AttentionKind]:
        return [AttentionKind.parse(name, entry) for name, entry in self.attention.items()]

    def runs(self) -> list[Run]:
        """Seed by seed (a sweep stopped after its first seed is a whole single-seed study), then size
        by size, then attention by attention; the extra seeds last."""
        kinds = self.attention_kinds()
        runs = [Run(self, size, kind.name, seed) for seed in self.seeds or [None] for size in self.sizes
                for kind in kinds if kind.trains(size)]
        return runs + [Run(self, size, kind.name, seed) for size in self.sizes
                       for seed in self.extra_seeds.get(size.name, []) for kind in kinds if kind.trains(size)]


@dataclass
class Run:
    spec: SweepSpec
    size: ModelSize
    attention_name: str
    seed: int | None = None

    @property
    def name(self) -> str:
        base = f"{self.size.name}-{self.attention_name}"
        return base if self.seed is None else f"{base}-seed{self.seed}"

    @property
    def kind(self) -> AttentionKind:
        return AttentionKind.parse(self.attention_name, self.spec.attention[self.attention_name])

    @property
    def folder(self) -> Path:
        return Path(self.spec.out_dir) / self.name

    def model_config(self):
        """The run's :class:`flexmoba.model.ModelConfig`."""
        from flexmoba.model import ModelConfig  # here, not at the top: ``flexmoba sweep --help`` is quick

        size = {k: v for k, v in asdict(self.size).items() if k != "name"}  # n_kv_heads None: one per head
        return ModelConfig(**{**size, **self.kind.model})

    def steps(self) -> int:
        """Optimizer steps for ``tokens_per_parameter`` tokens per non-embedding parameter."""
        n = self.model_config().num_parameters(non_embedding=True)
        tokens = self.spec.tokens_per_parameter * n
        return max(self.spec.min_steps, math.ceil(tokens / (self.spec.batch_size * self.spec.seq_len)))

    def settings(self) -> dict:
        """What this run sets on top of the base config, as ``{dotted.key: typed value}``."""
        spec, steps = self.spec, self.steps()
        config = self.model_config()
        size_fields = ("n_layers", "d_model", "n_heads", "n_kv_heads")
        model = {f"model.config.{key}": getattr(config, key) for key in size_fields}
        model.update({f"model.config.{key}": value for key, value in self.kind.model.items()})
        seeds = {} if self.seed is None else {"seed_everything": self.seed, "data.init_args.seed": self.seed}
        optional = {"model.lr": spec.lr} if spec.lr is not None else {}
        return {
            "trainer.default_root_dir": str(self.folder),
            "trainer.max_steps": steps,
            "trainer.val_check_interval": steps,
            "trainer.limit_val_batches": spec.limit_val_batches,
            "checkpoint.every_n_train_steps": max(1, steps // 10),
            "data.init_args.seq_len": spec.seq_len,
            "data.init_args.batch_size": spec.batch_size,
            "model.warmup_steps": max(1, int(spec.warmup_fraction * steps)),
            "model.position_window": spec.position_window,
            "model.trailing_window": spec.trailing_window,
            **optional,
            **model,
            **seeds,
            "trainer.callbacks": self.callbacks(),
        }

    def config(self, base: dict) -> dict:
        """The run's ``flexmoba fit`` config: ``base`` (the parsed base config) with :meth:`settings`."""
        config = json.loads(json.dumps(base))  # a deep copy of plain data
        for key, value in self.settings().items():
            if key == "trainer.callbacks":
                value = (config["trainer"].get("callbacks") or []) + value
            set_dotted(config, key, value)
        return config

    def callbacks(self) -> list[dict]:
        """The phase switch of a hybrid, and gate diagnostics where the sweep asks for them."""
        callbacks = []
        if self.kind.switch_to_full_at is not None:
            callbacks.append({"class_path": "lit.training.callbacks.AttentionPhaseSwitch",
                              "init_args": {"switch_to_full_at": self.kind.switch_to_full_at}})
        if self.name in self.spec.gate_diagnostics:
            callbacks.append({"class_path": "lit.experiments.gate_diagnostics.GateDiagnostics",
                              "init_args": {"max_sequences": 1}})
        return callbacks

    def compute(self) -> dict:
        """Training compute in PFLOP/s-days: the paper's 6·N·D, and with attention included (a
        hybrid's full-attention steps at full attention's cost)."""
        config = self.model_config()
        tokens = self.steps() * self.spec.batch_size * self.spec.seq_len
        n = config.num_parameters(non_embedding=True)
        full_share = self.kind.full_share()
        per_token = ((1 - full_share) * config.flops_per_token(self.spec.seq_len)
                     + full_share * config.flops_per_token(self.spec.seq_len, ["full"] * config.n_layers))
        return {
            "params_non_embedding": n,
            "tokens": tokens,
            "compute_6nd": pflops_days(6 * n * tokens),
            "compute_total": pflops_days(per_token * tokens),
        }

    def estimated_seconds(self) -> float | None:
        """Wall time from the sweep's measured ``step_seconds``: the training steps (a hybrid's last
        ones at full attention's speed), the final validation (after a hybrid's switch: at full
        attention's speed; each batch a forward, a third of a step) and gate diagnostics if asked."""
        base = self.model_config().attention
        n = self.model_config().num_parameters(non_embedding=True)
        if base not in self.spec.step_seconds or (self.kind.full_share() and "full" not in self.spec.step_seconds):
            return None
        step = val_step = interpolate_log_log(self.spec.step_seconds[base], n)
        if self.kind.full_share():
            val_step = interpolate_log_log(self.spec.step_seconds["full"], n)
            step = (1 - self.kind.full_share()) * step + self.kind.full_share() * val_step
        seconds = RUN_OVERHEAD_SECONDS + self.steps() * step + self.spec.limit_val_batches * val_step / 3
        if self.name in self.spec.gate_diagnostics:
            seconds += GATE_SECONDS_PER_LAYER_32K * self.size.n_layers * (self.spec.seq_len / 32768) ** 2
        return seconds


def set_dotted(config: dict, key: str, value) -> None:
    """``config["a"]["b"] = value`` for ``key = "a.b"``; a dict value for a dict merges into it."""
    *parents, last = key.split(".")
    for name in parents:
        config = config.setdefault(name, {})
    if isinstance(value, dict) and isinstance(config.get(last), dict):
        config[last] = {**config[last], **value}
    else:
        config[last] = value


def interpolate_log_log(points: list[list[float]], x: float) -> float:
    """``y(x)`` through measured ``[[x, y], ...]``, piecewise linear in log-log, extended by the end slopes."""
    points = sorted(points)
    if len(points) == 1:
        return points[0][1] * x / points[0][0]  # one point: proportional
    logs = [(math.log(px), math.log(py)) for px, py in points]
    lx = math.log(x)
    i = next((i for i in range(1, len(logs) - 1) if lx < logs[i][0]), len(logs) - 1)
    (x0, y0), (x1, y1) = logs[i - 1], logs[i]
    return math.exp(y0 + (y1 - y0) * (lx - x0) / (x1 - x0))


@dataclass(frozen=True)
class Processes:
    """The processes running the sweep: ``WORLD_SIZE``/``RANK``/``LOCAL_WORLD_SIZE`` as torchrun sets them."""

    world: int = 1
    rank: int = 0
    local_world: int = 1

    @classmethod
    def from_env(cls) -> Processes:
        if "WORLD_SIZE" not in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1:
            raise RuntimeError("flexmoba sweep under srun with several tasks: start one torchrun per node "
                               "instead (srun --ntasks-per-node 1 torchrun --nnodes ... -m lit.cli.main sweep ...), "
                               "so that the "
                               "processes know their ranks and rank 0 alone plans and writes")
        world = int(os.environ.get("WORLD_SIZE", 1))
        return cls(world, int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def launch_settings(self, spec: SweepSpec) -> dict:
        """Trainer and batch settings for this many processes (not part of a run's settings)."""
        if self.world == 1:
            return {}
        if spec.batch_size % self.world:
            raise ValueError(f"batch_size {spec.batch_size} is the global batch: it must divide evenly over "
                             f"{self.world} processes")
        # The strategy is left to the configs: Lightning's "auto" is DDP on several devices.
        return {"trainer.devices": self.local_world, "trainer.num_nodes": self.world // self.local_world,
                "data.init_args.batch_size": spec.batch_size // self.world}

    def share(self, decide):
        """``decide()`` on rank 0, its value (or its exception) on every rank."""
        if self.world == 1:
            return decide()
        import torch.distributed as dist

        outcome = [None]
        if self.is_main:
            try:
                outcome = [("value", decide())]
            except Exception as error:  # every rank must raise it, or the others would wait forever
                outcome = [("error", error)]
        dist.broadcast_object_list(outcome, src=0, group=_coordination_group())
        kind, value = outcome[0]
        if kind == "error":
            raise value
        return value

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=_coordination_group())


_GROUP = None


def _coordination_group():
    """A gloo group for the sweep's own messages (the default group may be NCCL, set up first here
    from torchrun's environment; Lightning then reuses it)."""
    import torch.distributed as dist

    global _GROUP
    if _GROUP is None:
        if not dist.is_initialized():
            dist.init_process_group("cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo")
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def machine_settings(base: dict) -> dict:
    """``bf16-mixed`` on a CUDA machine unless the base config sets a precision (like the process
    count, a property of the machine, not of a run's settings)."""
    import torch

    if torch.cuda.is_available() and base["trainer"].get("precision") is None:
        return {"trainer.precision": "bf16-mixed"}
    return {}


def base_config(spec: SweepSpec) -> dict:
    """The sweep's base config (``base_config`` with ``cli_args``), parsed and checked once like fit's."""
    from lit.training.launch import read_config  # Lightning is imported only when runs really happen

    return read_config(["--config", spec.base_config, *spec.cli_args], prog="flexmoba sweep")


def execute(run: Run, base: dict, resume: bool, processes: Processes = Processes(), announce: bool = False) -> dict:
    """Fit (or resume) one run and validate it; rank 0 writes its ``result.json``. With ``announce`` the run
    says what data it reads when it starts (the sweep's first run to train does)."""
    from lit.training.launch import fit_and_validate
    from lit.training.progress import StartLines

    config = run.config(base)
    for key, value in {**processes.launch_settings(run.spec), **machine_settings(base)}.items():
        set_dotted(config, key, value)
    started = time.time()
    start = StartLines(moba=False, lift="add {options} to the sweep config's cli_args to use them all",
                       option="{name}=null") if announce else None
    cli, metrics = fit_and_validate(config, resume=resume, start=start)
    result = {
        "run": run.name,
        "size": run.size.name,
        "attention": run.attention_name,
        "seed": run.seed,
        "seq_len": run.spec.seq_len,
        "switch_to_full_at": run.kind.switch_to_full_at,
        "steps": run.steps(),
        "seconds": time.time() - started,
        "resumed": resume,
        "settings": recorded(run.settings()),
        **run.compute(),
        "metrics": metrics,
    }
    if processes.is_main:
        result |= far_context(run, cli)
        (run.folder / "result.json").write_text(json.dumps(result, indent=2))
    processes.barrier()
    return result


def far_context(run: Run, cli) -> dict:
    """``{"long_range": ...}`` (:func:`lit.experiments.long_range_eval.evaluate`) on the validation
    sequences when the run trained on LongRangeData, else ``{}``."""
    import torch

    from lit.experiments.long_range_eval import evaluate
    from lit.training.long_range import LongRangeData

    data = cli.datamodule
    if not isinstance(data, LongRangeData):
        return {}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = cli.model.model.to(device).eval()
    sequences = run.spec.limit_val_batches * run.spec.batch_size
    windows = max(1, run.spec.seq_len // run.spec.position_window)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return {"long_range": evaluate(model, data, sequences, windows=windows, device=device)}


def recorded(settings: dict) -> dict:
    """Settings as they read back from JSON (tuples become lists), for comparing with a finished run's."""
    return json.loads(json.dumps(settings))


PLAN_WORDS = {"start": "starting", "resume": "resuming"}


def plan_runs(spec: SweepSpec) -> list[tuple[str, dict | None]]:
    """Per run: ``("done", result)``, ``("resume", None)`` or ``("start", None)``, from its folder."""
    plan = []
    for run in spec.runs():
        done = run.folder / "result.json"
        if done.exists():
            result = json.loads(done.read_text())
            if result.get("settings") != recorded(run.settings()):
                raise ValueError(f"run {run.name} in {run.folder} finished under other settings than the sweep "
                                 "config now asks for; use a new out_dir or delete that run's folder")
            plan.append(("done", result))
        else:
            plan.append(("resume" if any((run.folder / "checkpoints").glob("*.ckpt")) else "start", None))
    return plan


def run_sweep(spec: SweepSpec, processes: Processes = Processes()) -> list[dict]:
    """Run every unfinished run of the sweep, in order, and return all results.

    Rank 0 reads the folders and decides; every rank follows that one plan.
    """
    runs = spec.runs()
    plan = processes.share(lambda: plan_runs(spec))
    base = base_config(spec) if any(state != "done" for state, _ in plan) else None
    say = print if processes.is_main else lambda *args, **kwargs: None
    if processes.is_main and base is not None:
        for note in moba_notes(spec):
            sys.stderr.write(f"flexmoba: {note}\n")
    results, announced = [], False
    for i, (run, (state, result)) in enumerate(zip(runs, plan, strict=True), 1):
        if state == "done":
            say(f"[{i}/{len(runs)}] {run.name}: done, skipped", flush=True)
            results.append(result)
            continue
        say(f"[{i}/{len(runs)}] {run.name}: {PLAN_WORDS[state]}, {run.steps()} steps", flush=True)
        results.append(execute(run, base, resume=state == "resume", processes=processes, announce=not announced))
        announced = True
    return results


def moba_notes(spec: SweepSpec) -> list[str]:
    """One ``note: <attention>: ...`` per attention type of the sweep whose MoBA equals full attention at its
    ``seq_len`` (:func:`lit.training.progress.moba_note`)."""
    from lit.training.progress import moba_note

    notes = {}
    for run in spec.runs():
        if run.attention_name not in notes:
            note = moba_note(run.model_config(), spec.seq_len)
            notes[run.attention_name] = note and f"note: {run.attention_name}: {note.removeprefix('note: ')}"
    return [note for note in notes.values() if note]


def print_plan(spec: SweepSpec) -> float | None:
    """Print every run's steps, parameters, tokens, compute and estimated minutes; return the total minutes."""
    total = 0.0
    for run in spec.runs():
        c, seconds = run.compute(), run.estimated_seconds()
        estimate = "" if seconds is None else f", ~{seconds / 60:.1f} min"
        print(f"{run.name}: {run.steps()} steps, N={c['params_non_embedding']}, D={c['tokens']} "
              f"({c['tokens'] / c['params_non_embedding']:.1f} tokens/param), C={c['compute_6nd']:.3g} PFLOP/s-days "
              f"(6ND), {c['compute_total']:.3g} (spent){estimate}")
        total = None if seconds is None or total is None else total + seconds
    if total is None:
        print("estimated total: unknown (give step_seconds for every attention the runs use)")
        return None
    print(f"estimated total: {total / 60:.0f} min for {len(spec.runs())} runs")
    return total / 60


def main(argv: list[str] | None = None) -> None:
    parser = OneLineArgumentParser(prog="flexmoba sweep", description=__doc__)
    parser.add_argument("config", type=Path, help="sweep YAML, e.g. configs/sweep/toy.yaml")
    parser.add_argument("--report_only", "--report-only", action="store_true",
                        help="only rebuild the report from finished runs")
    parser.add_argument("--plan", action="store_true", help="print the runs, their steps, compute, minutes; exit")
    args = parser.parse_args(argv)

    spec = read_spec(args.config)
    if args.plan:
        print_plan(spec)
        return
    processes = Processes.from_env()
    if args.report_only and not list(Path(spec.out_dir).glob("*/result.json")):
        raise UsageError("--report_only", f"no finished runs in {spec.out_dir} (the sweep's out_dir) to report on",
                         f"run the sweep first: flexmoba sweep {args.config}")
    if not args.report_only:
        run_sweep(spec, processes)
    if not processes.is_main:
        return
    from lit.experiments.scaling_report import write_report

    report = write_report(Path(spec.out_dir), report_dir=spec.report_dir)
    copied = f" (copied to {spec.report_dir})" if spec.report_dir else ""
    print(f"flexmoba: sweep done: report {report}{copied}; runs, checkpoints and logs in {spec.out_dir}/<run>/")


def read_spec(path: Path) -> SweepSpec:
    """The sweep YAML at ``path``; a missing file or a bad key is one line naming it."""
    if not path.is_file():
        raise UsageError("config", f"{path} {'is a folder' if path.is_dir() else 'does not exist'}",
                         "give a sweep YAML, e.g. configs/sweep/toy.yaml")
    try:
        return SweepSpec.from_yaml(path)
    except (ValueError, TypeError, yaml.YAMLError) as error:
        raise UsageError("config", str(error)) from None
