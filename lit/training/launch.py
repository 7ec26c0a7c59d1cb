"""The one launcher: a config in, a finished, validated run out.

Every training run goes through :class:`FlexMobaCLI` (LightningCLI over :class:`LitLM` and
any LightningDataModule) and its :meth:`FlexMobaCLI.instantiate_trainer`: ``flexmoba fit``
with the command line's arguments, ``flexmoba compare`` and ``flexmoba sweep`` with typed
config dicts (:func:`fit_and_validate`). So every run gets the same checks at parse time,
divergence guard, atomic checkpoints, run-folder rules, loggers and resume, and on CPU glibc's
malloc thresholds fixed (:func:`flexmoba.host_memory.keep_freed_memory`). A config it refuses
raises :class:`~lit.training.errors.ConfigError` or :class:`~lit.training.errors.UsageError`
naming the option; the ``flexmoba`` command says either as one line, exit code 2 (:mod:`lit.cli.errors`).

``data`` defaults to :class:`ByteFilesData` (this Python's standard library as the corpus);
another module is named by ``data.class_path`` (e.g. ``lit.experiments.retrieval.RetrievalData``,
see ``configs/retrieval/``). Every data module must take ``seq_len``, linked to ``model.seq_len``.

Checkpoints go to ``<trainer.default_root_dir>/checkpoints`` (``last.ckpt`` kept), so
``--ckpt_path last`` resumes or evaluates the latest one. Logs: CSV under
``<root>/csv/version_*/metrics.csv`` and TensorBoard under ``<root>/tb``, plus any loggers
given with ``--trainer.logger`` (W&B, MLflow, ...); ``--default_loggers false`` drops CSV and
TensorBoard. ``predict`` writes ``<root>/predictions/predictions-rank<R>.jsonl``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import logging
import os
import signal
import threading
import warnings
from pathlib import Path

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from flexmoba.checkpoint import architecture_mismatch, checkpoint_config, checkpoint_tokenizer, read_checkpoint
from flexmoba.host_memory import keep_freed_memory
from flexmoba.model import ModelConfig
from lit.training import checks
from lit.training import metric_names as names
from lit.training.data import ByteFilesData, CorpusError
from lit.training.errors import ConfigError, RunInterrupted, UsageError, is_rank_zero
from lit.training.guards import (
    AtomicCheckpointIO,
    DivergenceGuard,
    InterruptAtBatchBoundaries,
    SafeModelCheckpoint,
    checkpoint_problem,
    newest_intact_checkpoint,
)
from lit.training.help_page import HELP_EXTRAS, HELP_ORDER, HELP_TITLES, group_key, is_lightnings, short_usage
from lit.training.metrics import position_windows, trailing_window
from lit.training.module import LitLM
from lit.training.options import option_names
from lit.training.predictions import JsonlPredictionWriter
from lit.training.progress import StartLines, progress_seconds, run_summary, say, with_own_display


def checkpoint_dir(default_root_dir: str | None) -> str:
    return os.path.join(default_root_dir or os.getcwd(), "checkpoints")


def default_loggers(root: str) -> list:
    return [CSVLogger(root, name="csv"), TensorBoardLogger(root, name="tb")]


def trainer_loggers(given, root: str, with_defaults: bool):
    """CSV + TensorBoard (first, so metrics.csv stays where it was) plus the user's loggers;
    ``False`` (no logging) stays ``False``."""
    if given is False:
        return False
    user = [] if given in (None, True) else list(given) if isinstance(given, (list, tuple)) else [given]
    loggers = (default_loggers(root) if with_defaults else []) + user
    return loggers or False


# The training recipe's Trainer half (the optimizer and schedule are LitLM's defaults): every run, fit,
# compare and sweep alike, starts from it; a config sets only its budget (steps, validation cadence).
TRAINER_RECIPE = {"trainer.gradient_clip_val": 1.0, "trainer.log_every_n_steps": 10}


class LauncherParser(LightningArgumentParser):
    """The launcher's parser: options spelled out (an abbreviation such as ``--trainer.max_step`` is refused);
    a refused value raises :class:`ConfigError` with the parser's message and every option it takes, which
    the ``flexmoba`` command says as one line naming the option (:mod:`lit.cli.errors`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            super().error(message, ex)
        raise ConfigError(message, self.option_names())

    def option_names(self) -> list[str]:
        """Every option this parser takes, the model config's and the default data module's included."""
        names = [name for name in self._option_string_actions if name.startswith("--")]
        data = [f"--data.{name}" for name in inspect.signature(ByteFilesData).parameters]
        return names + option_names(ModelConfig, "--model.config.") + data

    def format_help(self, formatter=None) -> str:
        """flexmoba's options first: the run's own, the model's training, its architecture (``--model.config.*``,
        which Lightning's page leaves to ``--model.config.help``), the default data module's (``--data.*``, left to
        ``--data.help``), checkpoints, the divergence guard, predictions; Lightning's after them (the Trainer,
        the optimizer and LR scheduler, links). A short usage line instead of one naming every option."""
        groups = list(self._action_groups)
        if "trainer" not in map(group_key, groups):
            return super().format_help(formatter)
        lightning = [group for group in groups if is_lightnings(group)]
        own = sorted((group for group in groups if not is_lightnings(group)),
                     key=lambda group: HELP_ORDER.index(group_key(group)) if group_key(group) in HELP_ORDER
                     else len(HELP_ORDER))  # stable: groups of one key keep their order
        for group in list(own):
            if group_key(group) in HELP_EXTRAS:
                at = own.index(group) + 1
                own[at:at] = HELP_EXTRAS[group_key(group)]()
        titles = {group: group.title for group in own + lightning}
        usage = self.usage
        for group in groups:
            group.title = HELP_TITLES.get(group_key(group), group.title)
        self._action_groups, self.usage = own + lightning, short_usage(self.prog)
        try:
            return super().format_help(formatter) if formatter is not None else super().format_help()
        finally:
            self._action_groups, self.usage = groups, usage
            for group, title in titles.items():
                group.title = title


def model_config_problem(fields: dict) -> str | None:
    """Why these ``ModelConfig`` fields cannot build a model (``--model.config: `` and ModelConfig's own
    words, which name the field), or None."""
    try:
        ModelConfig(**fields)
    except (TypeError, ValueError) as error:
        return f"--model.config: {error}"
    return None


def as_dict(value) -> dict:
    return value.as_dict() if isinstance(value, Namespace) else dict(value or {})


def config_problem(config: Namespace) -> str | None:
    """The first invalid value of a subcommand's parsed config (model and data), or None."""
    data = as_dict(config.get("data"))
    seq_len = data.get("init_args", data).get("seq_len")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        return f"--data.seq_len: must be a positive int, got {seq_len!r}"
    batch_size = data.get("init_args", data).get("batch_size", 1)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        return f"--data.batch_size: must be a positive int, got {batch_size!r}"
    model = as_dict(config.get("model"))
    model = model.get("init_args", model)
    fields = model.get("config")
    if fields:
        problem = model_config_problem(as_dict(fields.get("init_args", fields)))
        if problem:
            return problem
    for name, rule, holds in (("lr", "a positive float", lambda v: v > 0),
                              ("warmup_steps", "an int >= 0", lambda v: v >= 0),
                              ("wsd_decay_steps", "an int >= 0", lambda v: v >= 0)):
        if model.get(name) is not None and not holds(model[name]):
            return f"--model.{name}: must be {rule}, got {model[name]!r}"
    window_checks = (("position_window", position_windows), ("trailing_window", trailing_window))
    for name, check in window_checks:
        if name in model:
            try:
                check(seq_len, model[name])
            except ValueError as error:
                return f"--model.{name}: {error}"
    return None


def data_class(data: dict):
    module, _, name = data["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)


def follow_data_vocabulary(config: Namespace) -> str | None:
    """Set the model's ``vocab_size`` to the data's, for a data module with a vocabulary of its own
    (``vocabulary_of(init_args)``, e.g. a tokenizer's); the problem, naming the option, if they differ."""
    data = as_dict(config.get("data"))
    vocabulary_of = getattr(data_class(data), "vocabulary_of", None) if data.get("class_path") else None
    if vocabulary_of is None:
        return None
    try:
        vocab = vocabulary_of(data.get("init_args", {}))
    except CorpusError as error:
        return f"--data.{error.option}: {error}"
    fields = config["model"].get("config")
    if fields is None:
        config["model"]["config"] = fields = Namespace(**dataclasses.asdict(ModelConfig()))
    if fields.vocab_size not in (vocab, ModelConfig.vocab_size):
        return (f"--model.config.vocab_size: {fields.vocab_size} does not match the data's vocabulary of {vocab} "
                "tokens; leave it out, it follows the data")
    fields.vocab_size = vocab
    return None


def model_mismatch(path: str, config: ModelConfig) -> str | None:
    """How the model saved in ``path`` differs in architecture from ``config``, or None."""
    return architecture_mismatch(checkpoint_config(read_checkpoint(path)), config)


def init_from_problem(config: Namespace) -> str | None:
    """Why ``--model.init_from`` cannot start this run, naming the option, or None: not a checkpoint, another
    architecture, a data tokenizer other than the one the weights were trained with."""
    model = as_dict(config.get("model"))
    path = model.get("init_args", model).get("init_from")
    if path is None:
        return None
    try:
        checkpoint = checks.checkpoint_file("--model.init_from", path)
    except UsageError as error:
        return str(error)
    mismatch = architecture_mismatch(checkpoint_config(checkpoint), parsed_model_config(config))
    if mismatch:
        return (f"--model.init_from: {path} holds another architecture ({mismatch}); set --model.config to the "
                "checkpoint's (see configs/pretrained/)")
    data = as_dict(config.get("data"))
    return tokenizer_problem(checkpoint_tokenizer(checkpoint), data.get("init_args", data), path)


def tokenizer_problem(expected: str | None, data: dict, path: str) -> str | None:
    """Why the data's tokens are not the ones the weights of ``path`` read (tokenizer ``expected``), or None."""
    if expected is None:
        return None
    given = data.get("tokenizer")
    if given is None:
        return (f"--data.tokenizer: the weights of {path} read the tokens of their own tokenizer; use "
                "--data lit.training.tokenizer.TokenFilesData --data.tokenizer <its tokenizer.json>")
    if not os.path.isfile(given) or json.loads(Path(given).read_text()) != json.loads(expected):
        return f"--data.tokenizer: {given} is not the tokenizer the weights of {path} were trained with"
    return None


def context_problem(config: Namespace) -> str | None:
    """``--data.seq_len`` beyond the model's context (``max_seq_len``), or None."""
    limit = parsed_model_config(config).max_seq_len
    data = as_dict(config.get("data"))
    seq_len = data.get("init_args", data).get("seq_len")
    if limit is not None and seq_len > limit:
        return (f"--data.seq_len: {seq_len} tokens exceed the model's context of {limit} "
                "(--model.config.max_seq_len); give at most that")
    return None


def parsed_model_config(config: Namespace) -> ModelConfig:
    """The ``ModelConfig`` a parsed config builds (its values already checked)."""
    model = as_dict(config.get("model"))
    fields = model.get("init_args", model).get("config")
    return ModelConfig(**as_dict(fields.get("init_args", fields))) if fields else ModelConfig()


def processes_of(trainer: dict) -> int | None:
    """How many processes the Trainer settings start (None when Lightning decides, e.g. ``devices: auto``)."""
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1) or 1
    if isinstance(devices, (list, tuple)):
        return len(devices) * nodes
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if devices == "auto":
        import torch

        on_cuda = trainer.get("accelerator") in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        devices = torch.cuda.device_count() if on_cuda else 1 if trainer.get("accelerator") in ("auto", "cpu") else None
    return devices * nodes if isinstance(devices, int) and devices > 0 else None


def trainer_problem(trainer: dict) -> str | None:
    """Why the Trainer settings cannot run on this machine, naming the option, or None."""
    try:
        checks.accelerator("--trainer.accelerator", trainer.get("accelerator"))
    except UsageError as error:
        return str(error)
    steps = trainer.get("max_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or (steps < 1 and steps != -1)):
        return f"--trainer.max_steps: must be a positive int (or -1: no limit), got {steps!r}"
    root = trainer.get("default_root_dir")
    if root and os.path.isfile(root):
        return f"--trainer.default_root_dir: {root} is a file, not a folder; give a folder for the run"
    strategy = as_dict(trainer.get("strategy")) if not isinstance(trainer.get("strategy"), str) else {}
    mesh = as_dict(strategy.get("init_args"))
    sizes = [mesh.get("data_parallel_size"), mesh.get("tensor_parallel_size", 1)]
    processes = processes_of(trainer)
    if strategy.get("class_path", "").endswith("ModelParallelStrategy") and all(isinstance(n, int) for n in sizes) \
            and processes is not None and sizes[0] * sizes[1] != processes:
        return (f"--trainer.strategy.init_args.data_parallel_size: {sizes[0]} x tensor_parallel_size {sizes[1]} "
                f"must equal the processes started ({processes}: --trainer.devices x --trainer.num_nodes); pass "
                f"--trainer.devices {sizes[0] * sizes[1]}, or --trainer.strategy.init_args.data_parallel_size "
                f"{processes // sizes[1] or 1}")
    return None


def backend_problem(config: Namespace, subcommand: str | None) -> str | None:
    """A MoBA backend that cannot train where the fit would run (flex has no CPU backward), named, or None.
    ``subcommand`` None is a job that trains (compare, continued-scaling)."""
    if subcommand not in (None, "fit") or not as_dict(config.get("model")).get("config"):
        return None
    model = parsed_model_config(config)
    accelerator = as_dict(config.get("trainer")).get("accelerator")
    import torch

    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())
    if on_cpu and model.moba.backend == "flex" and "moba" in model.layer_attention():
        return ("--model.config.moba.backend: flex cannot train on CPU (FlexAttention has no CPU backward); "
                "give auto or gather, or train on a GPU")
    return None


def resolve_last(config: Namespace, subcommand: str) -> str:
    """``--ckpt_path last``: the newest intact checkpoint of the run folder. A truncated one newer than it is
    skipped; when a fit resumes, a skipped ``last.ckpt`` is set aside so the fit writes a new one there."""
    folder = checkpoint_dir(config.trainer.get("default_root_dir"))
    chosen, skipped = newest_intact_checkpoint(folder) if os.path.isdir(folder) else (None, {})
    if chosen is None and skipped:
        raise UsageError("--ckpt_path", f"last: no usable checkpoint in {folder}: "
                         + "; ".join(f"{p.name} ({why})" for p, why in skipped.items()),
                         "drop --ckpt_path to start from scratch in another --trainer.default_root_dir")
    if chosen is None:
        fix = ("drop --ckpt_path to train from scratch" if subcommand == "fit" else
               "train it first (flexmoba fit with the same --config files), or give --ckpt_path PATH")
        raise UsageError("--ckpt_path", f"last: nothing to resume, no checkpoint in {folder}", fix)
    for path in skipped:
        set_aside = subcommand == "fit" and path.name == "last.ckpt"
        if set_aside and is_rank_zero():
            path.replace(path.with_name("last.ckpt.unreadable"))
        say(f"warning: --ckpt_path last: skipped unreadable {path.name}"
            + (" (moved to last.ckpt.unreadable)" if set_aside else "")
            + f"; using {chosen.name}, the newest intact checkpoint in {folder}")
    return str(chosen)


def checkpoint_to_use(config: Namespace, subcommand: str) -> str | None:
    """The checkpoint the subcommand's ``--ckpt_path`` names (``last`` resolved), checked against the
    config; :class:`UsageError` if it cannot be used. Evaluating without one is refused: it would score
    random weights."""
    ckpt_path = config.get("ckpt_path")
    if ckpt_path is None:
        model = as_dict(config.get("model"))
        if subcommand == "fit" or model.get("init_args", model).get("init_from") is not None:
            return None
        raise UsageError("--ckpt_path", f"{subcommand} without a checkpoint would score an untrained model",
                         "pass --ckpt_path last (the run folder's newest) or --ckpt_path PATH")
    if ckpt_path == "last":
        ckpt_path = resolve_last(config, subcommand)
    if os.path.isdir(ckpt_path) and checkpoint_problem(ckpt_path) is None:
        return ckpt_path  # a sharded checkpoint folder: Lightning's strategy reads it
    checks.checkpoint_file("--ckpt_path", ckpt_path)
    mismatch = model_mismatch(ckpt_path, parsed_model_config(config))
    if mismatch:
        raise UsageError("--ckpt_path", f"{ckpt_path} holds another model ({mismatch})",
                         "pass the --config files and --model.config options it was trained with, "
                         "or another checkpoint")
    return ckpt_path


def saved_step(folder: str | os.PathLike | None) -> tuple[bool, int | None]:
    """Whether ``folder`` holds a checkpoint to resume from, and the step of the newest intact one
    (None when it is a sharded checkpoint folder or none is there)."""
    if not folder or not os.path.isdir(folder):
        return False, None
    newest, _ = newest_intact_checkpoint(folder)
    if newest is None:
        return False, None
    if newest.is_dir():
        return True, None
    try:
        return True, int(read_checkpoint(newest)["global_step"])
    except Exception:  # an unreadable step is only left unsaid
        return True, None


def interrupted(trainer: L.Trainer | None) -> RunInterrupted:
    """What Ctrl-C stopped: the step the run reached and the newest checkpoint of its folder. Lightning
    ignores SIGINT once it has caught one (to shut down); a second Ctrl-C works again from here."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if trainer is None:
        return RunInterrupted(None, None)
    callback = trainer.checkpoint_callback
    resumable, step = saved_step(callback.dirpath if callback is not None else None)
    return RunInterrupted(trainer.global_step, step, str(trainer.default_root_dir), resumable)


@contextlib.contextmanager
def interrupts_as_one_line(trainer_of):
    """Ctrl-C inside: :class:`RunInterrupted` for ``trainer_of()``'s run. Lightning turns a KeyboardInterrupt
    in ``fit``/``validate`` into ``SystemExit(1)`` once it has shut down; this tells it by its cause."""
    try:
        yield
    except SystemExit as stop:
        if not isinstance(stop.__context__, KeyboardInterrupt):
            raise
        raise interrupted(trainer_of()) from None
    except KeyboardInterrupt:
        raise interrupted(trainer_of()) from None


class FlexMobaCLI(LightningCLI):
    def __init__(self, *args, start: StartLines | None = None, **kwargs):
        self.start = start  # what the fit says when it starts (its data, a MoBA that cannot be sparse)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(SafeModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(DivergenceGuard, "divergence_guard")
        parser.add_lightning_class_args(JsonlPredictionWriter, "predictions")
        parser.add_argument("--default_loggers", type=bool, default=True,
                            help="log to CSV and TensorBoard under the run folder, beside --trainer.logger")
        parser.set_defaults(TRAINER_RECIPE)
        parser.set_defaults({
            "checkpoint.save_last": True,
            "checkpoint.filename": "step{step:06d}",
            "checkpoint.auto_insert_metric_name": False,
            "checkpoint.save_top_k": 1,
        })
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        # Subclass mode with a default class: old configs' bare ``data:`` arguments still apply to it.
        parser.set_defaults({"data": {"class_path": f"{ByteFilesData.__module__}.{ByteFilesData.__name__}"}})
        parser.link_arguments("data.init_args.seq_len", "model.seq_len")

    def parse_arguments(self, parser, args) -> None:
        """Parse, then refuse invalid values and unusable checkpoints before anything is seeded or built."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        self.complete(config)
        problem = (follow_data_vocabulary(config) or config_problem(config) or context_problem(config)
                   or init_from_problem(config) or trainer_problem(as_dict(config.get("trainer")))
                   or backend_problem(config, subcommand))
        if problem:
            parser.error(problem)
        try:
            progress_seconds()  # a progress interval that is not seconds: said before anything runs
            # ``last`` stays in the config until the run starts: only an explicit path makes Lightning
            # take the model's hyperparameters from the checkpoint.
            self.checkpoint = checkpoint_to_use(config, subcommand) if subcommand else None
        except UsageError as error:
            parser.error(str(error))

    def complete(self, config: Namespace) -> None:
        """Fill in values that depend on others (a hook for jobs that read configs)."""

    def instantiate_trainer(self, **kwargs):
        trainer_config = self._get(self.config_init, "trainer", default={})
        if "logger" not in kwargs:
            kwargs["logger"] = trainer_loggers(trainer_config.get("logger"),
                                               trainer_config.get("default_root_dir") or os.getcwd(),
                                               self._get(self.config_init, "default_loggers", default=True))
        if not trainer_config.get("plugins") and "plugins" not in kwargs:
            kwargs["plugins"] = [AtomicCheckpointIO()]
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks.append(InterruptAtBatchBoundaries())
        if trainer.strategy.root_device.type == "cpu":
            keep_freed_memory()  # page faults on every step's temporaries otherwise (flexmoba/host_memory.py)
        return with_own_display(trainer, self.start)

    def check_data(self) -> None:
        """A corpus that cannot work (no files, patterns matching nothing, files too short) is one
        line naming the option, before anything is read or trained."""
        check_files = getattr(self.datamodule, "check_files", None)
        if check_files is None:
            return
        try:
            check_files()
        except CorpusError as error:
            self.parser.error(f"--data.{error.option}: {error}")

    def check_run_folder(self) -> None:
        """One run folder holds one model: a fresh fit into a folder with checkpoints is refused (a checkpoint
        of another shape was refused at parse time, before Lightning's size-mismatch traceback)."""
        config = self.config_init[self.subcommand]
        ckpt_path, callback = config.get("ckpt_path"), self.trainer.checkpoint_callback
        folder = Path(callback.dirpath) if callback is not None and callback.dirpath else None
        if self.subcommand == "fit" and ckpt_path is None and folder is not None and list(folder.glob("*.ckpt")):
            root = self.trainer.default_root_dir
            self.parser.error(f"--trainer.default_root_dir: {root} already holds a run's checkpoints "
                              f"({', '.join(sorted(p.name for p in folder.glob('*.ckpt')))}); resume it with "
                              "--ckpt_path last, or give another --trainer.default_root_dir")
        if self.subcommand == "predict":
            self.check_predictions_folder()

    def check_predictions_folder(self) -> None:
        """Predictions of an earlier predict are not replaced: the folder must hold none."""
        writers = [c for c in self.trainer.callbacks if isinstance(c, JsonlPredictionWriter)]
        given = writers[0].output_dir if writers else None
        folder = Path(given or Path(self.trainer.default_root_dir) / "predictions")
        earlier = sorted(p.name for p in folder.glob("predictions-rank*.jsonl"))
        if earlier:
            self.parser.error(f"--predictions.output_dir: {folder} already holds predictions ({', '.join(earlier)}); "
                              "give another --predictions.output_dir, or delete them to predict again")

    def before_subcommand(self) -> None:
        self.config_init[self.subcommand]["ckpt_path"] = self.checkpoint
        self.check_data()
        self.check_run_folder()

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            with interrupts_as_one_line(lambda: getattr(self, "trainer", None)):
                super()._run_subcommand(subcommand)
        except CorpusError as error:  # e.g. a checkpoint of another corpus, found when Lightning restores it
            self.parser.error(f"--data.{error.option}: {error}")

    def after_subcommand(self) -> None:
        say(run_summary(self.trainer, self.subcommand, self.checkpoint))

    before_fit = before_validate = before_test = before_predict = before_subcommand
    after_fit = after_validate = after_test = after_predict = after_subcommand


def run_cli(args: list[str] | None = None, start: StartLines | None = None) -> FlexMobaCLI:
    """Run the CLI (in-process when ``args`` are given) and return it, trainer and model included. A fit
    says what ``start`` says when it starts (default: its data, and a MoBA that cannot be sparse)."""
    with warnings.catch_warnings():
        # ByteFilesData resumes mid-epoch through its own state_dict (see lit/training/data.py);
        # Lightning's check only looks at the DataLoader, so its warning would be wrong here.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")  # a job's own argv
        return FlexMobaCLI(
            LitLM,
            L.LightningDataModule,
            subclass_mode_data=True,
            args=args,
            start=StartLines() if start is None else start,
            parser_class=LauncherParser,
            seed_everything_default=1337,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": "Train and evaluate MoBA / full-attention byte-level LMs (see configs/)."},
        )


def fit_and_validate(config: dict, *, resume: bool = False, limit_val_batches: int | None = None,
                     start: StartLines | None = None) -> tuple[FlexMobaCLI, dict]:
    """Fit the run ``config`` describes (a parsed ``flexmoba fit`` config as a dict of typed values),
    resuming from its ``last.ckpt`` if asked, and return the CLI and its final validation metrics.

    The final validation is the one that ended the fit when it ran at the last step with
    ``limit_val_batches`` batches (or the config's), else a new one: one validation, not two. The fit
    says what ``start`` says when it starts (default: nothing, the job says it once for all its runs).
    Ctrl-C raises :class:`RunInterrupted`.
    """
    if resume:
        config = {**config, "ckpt_path": "last"}
    cli = run_cli({"fit": config}, start=start or StartLines(data=False, moba=False))
    trainer = cli.trainer
    if limit_val_batches is None and names.loss("val") in trainer.callback_metrics:
        return cli, {k: float(v) for k, v in trainer.callback_metrics.items() if not names.of_stage(k, "train")}
    if limit_val_batches is not None:
        trainer.limit_val_batches = limit_val_batches
    with interrupts_as_one_line(lambda: trainer):
        metrics = trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    return cli, {k: float(v) for k, v in metrics.items()}


class ConfigReader(FlexMobaCLI):
    """Parses and checks a ``flexmoba fit``-style command line into a config, building nothing."""

    def __init__(self, args: list[str], extra_arguments=None, defaults: dict | None = None, complete=None, **kwargs):
        self.extra_arguments, self.defaults, self.completion = extra_arguments, defaults or {}, complete
        super().__init__(LitLM, L.LightningDataModule, subclass_mode_data=True, args=args, run=False,
                         parser_class=LauncherParser, seed_everything_default=1337, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        if self.extra_arguments:
            self.extra_arguments(parser)
        parser.set_defaults(self.defaults)

    def complete(self, config: Namespace) -> None:
        if self.completion is not None:
            self.completion(config)

    def instantiate_classes(self) -> None:
        pass


def read_config(args: list[str], extra_arguments=None, defaults: dict | None = None, complete=None,
                **parser_kwargs) -> dict:
    """``args`` parsed and checked like ``flexmoba fit``'s (one-line errors, exit 2), as a dict.

    ``extra_arguments(parser)`` adds a job's own options, ``defaults`` are its defaults, and
    ``complete(config)`` fills in values that depend on others before the checks run.
    """
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")  # reading seeds nothing worth saying
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            reader = ConfigReader(args, extra_arguments, defaults, complete, parser_kwargs=parser_kwargs)
    finally:
        seed_log.setLevel(level)
    config = reader.config.as_dict()
    config.pop("config", None)  # the --config files read: their values are in the config now
    problem = data_problem(config["data"])
    if problem:
        reader.parser.error(problem)
    return config


def data_problem(data: dict) -> str | None:
    """Why the data module of a config (``{class_path, init_args}``) cannot work, naming the option, or None.

    Builds the module (cheap: it lists files, reads none) to run its ``check_files``, if it has one.
    """
    datamodule = data_class(data)(**data.get("init_args", {}))
    try:
        getattr(datamodule, "check_files", lambda: None)()
    except CorpusError as error:
        return f"--data.{error.option}: {error}"
    return None
