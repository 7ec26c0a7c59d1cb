"""What a run shows while it trains: a progress bar counting steps (on a terminal), a progress line at least
every minute (when stdout is not a terminal: a log file, a pipe, a batch job), what the run reads and whether
its MoBA can be sparse (once, at the start), one line for the model, one at the end.

``FLEXMOBA_PROGRESS_SECONDS`` sets the most seconds between two progress lines (default 60; 0: a line every
step and every evaluation batch).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from lit.training import metric_names
from lit.training.ticker import DEFAULT_PROGRESS_SECONDS, PROGRESS_SECONDS, Ticker, progress_seconds  # noqa: F401


@rank_zero_only
def say(message: str) -> None:
    """One ``flexmoba: ...`` line on stderr from rank 0, shown even when Python warnings are silenced."""
    sys.stderr.write(f"flexmoba: {message}\n")


class StepProgressBar(RichProgressBar):
    """The training bar counts optimizer steps up to ``max_steps`` across epochs and resumes.

    Lightning's counts the epoch's batches and names the epoch out of ``max_epochs - 1``, which
    reads ``Epoch 0/-2`` when ``max_steps`` ends the fit (and ``20/10`` after a resume).
    """

    def counts_steps(self) -> bool:
        return self.trainer.max_steps is not None and self.trainer.max_steps > 0

    @property
    def total_train_batches(self):
        return self.trainer.max_steps if self.counts_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return "step" if self.counts_steps() else super()._get_train_description(current_epoch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        shown = trainer.global_step - 1 if self.counts_steps() else batch_idx  # the bar shows index + 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, shown)


class ModelLine(ModelSummary):
    """The model in one line (Lightning's table adds a FLOPs column that reads 0: it does not measure them)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = sum(p.numel() for p in pl_module.parameters())
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        config = getattr(pl_module, "config", None)
        shape = f" ({config.n_layers} layers, d_model {config.d_model}, {config.attention})" if config else ""
        say(f"model: {total:,} parameters, {trainable:,} trainable{shape}")


def with_own_display(trainer: L.Trainer, start: StartLines | None = None, interactive: bool | None = None) -> L.Trainer:
    """Lightning's default progress bar and model summary replaced by the two above (a user's own stay);
    :class:`ProgressLines` when stdout is not a terminal (``interactive``: whether it is), whatever
    ``enable_progress_bar`` says; ``start``, if given, says what the fit reads when it starts."""
    for i, callback in enumerate(trainer.callbacks):
        if type(callback) is RichProgressBar:
            trainer.callbacks[i] = StepProgressBar()
        elif type(callback) in (ModelSummary, RichModelSummary):
            trainer.callbacks[i] = ModelLine()
    every = progress_seconds()
    if not (getattr(sys.stdout, "isatty", lambda: False)() if interactive is None else interactive):
        trainer.callbacks.append(ProgressLines(every))
    if start is not None:
        trainer.callbacks.append(start)
    return trainer


# -- progress lines ------------------------------------------------------------------------

def duration(seconds: float) -> str:
    """``42s``, ``3m 20s``, ``2h 05m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def batch_tokens(batch) -> int:
    """Input tokens of an ``(inputs, targets, ...)`` batch (0 for a batch of another shape)."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return int(first.numel()) if hasattr(first, "numel") else 0


@dataclass
class Pace:
    """A stage's clock and counts since it started (``paused``: seconds that were not its own)."""

    began: float
    done_before: int = 0  # steps already taken when it started (a resumed fit)
    tokens: int = 0
    batches: int = 0
    paused: float = 0.0

    def seconds(self, now: float) -> float:
        return max(1e-9, now - self.began - self.paused)


EVAL_STAGES = {"validation": "num_val_batches", "test": "num_test_batches", "predict": "num_predict_batches"}


def step_loss(trainer: L.Trainer, pl_module: L.LightningModule, outputs) -> float | None:
    """The training loss of the batch that just ended, as logged: the step's own (``outputs``), or under context
    parallelism (where each rank returns its share) the last one logged, a step behind."""
    if getattr(getattr(pl_module, "model", None), "context_parallel", None) is None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and hasattr(loss, "numel") and loss.numel() == 1:
            return float(loss)
    logged = trainer.callback_metrics.get(metric_names.loss("train"))
    return None if logged is None else float(logged)


class ProgressLines(L.Callback):
    """A line on stderr at least every ``every_seconds`` while a run trains or evaluates, for when nobody sees
    a progress bar (stdout is not a terminal):

        flexmoba: step 37/100: loss 2.3412, 12,345 tokens/s, 1m 20s left
        flexmoba: validation batch 12/32: 3,456 tokens/s, 40s left
        flexmoba: step 38/100 (step 39 running for 1m 05s): 12,001 tokens/s, 1m 19s left

the last, from a timer (:class:`lit.training.ticker.Ticker`), while a step or batch runs past the interval.

    Rates count every process's tokens (this process's times the world size) over this session's time;
    training time leaves out the validations inside the fit. Reads the loss on the host once a line.
    """

    def __init__(self, every_seconds: float = DEFAULT_PROGRESS_SECONDS, clock=time.monotonic, ticking: bool = True):
        self.clock = clock
        self.ticker = Ticker(every_seconds, self.running_line, say, clock)
        self.ticking = ticking  # a line on a timer too, while a step or batch runs longer than the interval
        self.trainer: L.Trainer | None = None
        self.stage: str | None = None  # "train", or the evaluation running; None: nothing to say
        self.mark = clock()  # when the running step or batch began
        self.train: Pace | None = None
        self.eval: Pace | None = None

    def due(self) -> bool:
        return self.ticker.due()

    def say_if_due(self, line: Callable[[], str]) -> None:
        self.mark = self.clock()
        if self.due():
            say(line())

    def running_line(self) -> str | None:
        """The timer's line: the last one's figures and how long the running step or batch has taken."""
        trainer, stage = self.trainer, self.stage
        if trainer is None or stage is None:
            return None
        seconds = self.clock() - self.mark
        if seconds < 1:  # a step or batch just ended (the timer beat its own line to it): that line, as it is
            return self.training_line(trainer) if stage == "train" else self.evaluation_line(trainer, stage)
        running = duration(seconds)
        if stage == "train":
            return self.training_line(trainer, running=f" (step {trainer.global_step + 1} running for {running})")
        if self.eval is None or self.eval.batches == 0:
            return f"{stage}: batch 1 running for {running}"
        return self.evaluation_line(trainer, stage, running=f" (batch {self.eval.batches + 1} running for {running})")

    @rank_zero_only
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.trainer = trainer
        if self.ticking:
            self.ticker.start()

    @rank_zero_only
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stage = None
        self.ticker.stop()

    @rank_zero_only
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.train = Pace(self.clock(), trainer.global_step)
        self.trainer, self.stage, self.mark = trainer, "train", self.clock()
        self.ticker.said()

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.train.tokens += batch_tokens(batch) * trainer.world_size
        self.say_if_due(lambda: self.training_line(trainer, step_loss(trainer, pl_module, outputs)))

    def training_line(self, trainer: L.Trainer, loss: float | None = None, running: str = "") -> str:
        """``step 37/100: ...``; ``running`` (`` (step 38 running for 1m 05s)``) goes before the colon."""
        step, pace = trainer.global_step, self.train
        seconds = pace.seconds(self.clock())
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        parts = [] if loss is None else [f"loss {loss:.4f}"]
        parts.append(f"{pace.tokens / seconds:,.0f} tokens/s")
        taken = step - pace.done_before
        if taken > 0 and math.isfinite(total):
            parts.append(f"{duration((total - step) * seconds / taken)} left")
        shown_total = f"/{int(total)}" if math.isfinite(total) else ""
        return f"step {step}{shown_total}{running}: " + ", ".join(parts)

    def start_evaluation(self, trainer: L.Trainer, stage: str) -> None:
        self.eval = Pace(self.clock())
        self.trainer, self.stage, self.mark = trainer, stage, self.eval.began

    def count_evaluation(self, trainer: L.Trainer, batch, stage: str) -> None:
        self.eval.batches += 1
        self.eval.tokens += batch_tokens(batch) * trainer.world_size
        self.say_if_due(lambda: self.evaluation_line(trainer, stage))

    def evaluation_line(self, trainer: L.Trainer, stage: str, running: str = "") -> str:
        pace = self.eval
        seconds = pace.seconds(self.clock())
        total = sum(getattr(trainer, EVAL_STAGES[stage], None) or [math.inf])
        shown_total = f"/{int(total)}" if math.isfinite(total) else ""
        parts = [f"{pace.tokens / seconds:,.0f} tokens/s"] if pace.tokens else []
        if math.isfinite(total):
            parts.append(f"{duration((total - pace.batches) * seconds / pace.batches)} left")
        return f"{stage} batch {pace.batches}{shown_total}{running}: " + ", ".join(parts)

    @rank_zero_only
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.start_evaluation(trainer, "validation")

    @rank_zero_only
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *_,
                                **__) -> None:
        if not trainer.sanity_checking:
            self.count_evaluation(trainer, batch, "validation")

    @rank_zero_only
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING and self.train is not None \
                and self.eval is not None:
            self.train.paused += self.clock() - self.eval.began  # the training clock stood still meanwhile
            self.stage, self.mark = "train", self.clock()
        elif trainer.state.fn != TrainerFn.FITTING:
            self.stage = None

    @rank_zero_only
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_evaluation(trainer, "test")

    @rank_zero_only
    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *_, **__) -> None:
        self.count_evaluation(trainer, batch, "test")

    @rank_zero_only
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_evaluation(trainer, "predict")

    @rank_zero_only
    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *_,
                             **__) -> None:
        self.count_evaluation(trainer, batch, "predict")


# -- what a run says when it starts --------------------------------------------------------

def moba_note(config, seq_len: int) -> str | None:
    """``note: ...`` when MoBA with ``config`` (a :class:`flexmoba.model.ModelConfig`) cannot be sparse at
    ``seq_len``: ``seq_len <= chunk_size * top_k`` puts every earlier key in a selected chunk, for every
    query, so it equals full attention. None when it is sparse, or no layer runs MoBA."""
    if "moba" not in config.layer_attention():
        return None
    chunk_size, top_k = config.moba.chunk_size, config.moba.top_k
    if seq_len > chunk_size * top_k:
        return None
    return (f"note: MoBA at seq_len {seq_len} with chunk_size {chunk_size} × top_k {top_k} attends every "
            "earlier key (equals full attention); lower chunk_size or top_k to make it sparse")


class StartLines(L.Callback):
    """Once, when a fit starts (its data set up): the data it reads (the data module's ``summary(lift)``
    lines, if it has one: files, bytes, sequences per split, a cap from the config and how to lift it) and
    :func:`moba_note` for its model.

    Args:
        data: say what the data module reads.
        moba: say when the model's MoBA equals full attention at this sequence length.
        lift: how to lift a cap: ``{options}`` are the options to give, each written as ``option`` with
            ``{name}`` its name (``--data.max_files null``).
    """

    def __init__(self, data: bool = True, moba: bool = True, lift: str = "pass {options} to use them all",
                 option: str = "{name} null"):
        self.data, self.moba, self.lift, self.option = data, moba, lift, option

    @rank_zero_only
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = getattr(trainer.datamodule, "summary", None)
        if self.data and summary is not None:
            for line in summary(self.lift, self.option):
                say(line)
        config, seq_len = getattr(pl_module, "config", None), getattr(pl_module, "seq_len", None)
        note = moba_note(config, seq_len) if self.moba and config is not None and seq_len else None
        if note:
            say(note)


STAGE_OF = {"fit": "val", "validate": "val", "test": "test"}


def run_summary(trainer: L.Trainer, subcommand: str, loaded: str | None) -> str:
    """The line a run ends with: the checkpoint it started from, its loss, the checkpoint it saved (a fit) and
    where its logs are."""
    done = f"{subcommand} done" + (f" at step {trainer.global_step}" if subcommand == "fit" else "")
    parts = [done + (f" (from {loaded})" if loaded else "")]
    stage = STAGE_OF.get(subcommand)
    if stage:
        key = metric_names.loss(stage)
        loss = trainer.callback_metrics.get(key)
        parts.append(f"{key} {float(loss):.4f} ({counted(trainer.callback_metrics, stage)})" if loss is not None
                     else "no validation ran")
    callback = trainer.checkpoint_callback
    if subcommand == "fit":
        checkpoint = callback.last_model_path or callback.best_model_path if callback is not None else ""
        parts.append(f"checkpoint {shown(checkpoint) if checkpoint else 'none saved'}")
    logs = [shown(logger.log_dir) for logger in trainer.loggers if getattr(logger, "log_dir", None)]
    parts.append(f"logs {', '.join(logs) or 'none'}")
    return "; ".join(parts)


def shown(path: str) -> str:
    """``path`` as a line shows it: relative to the working directory when under it (as the logs' are)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'es' if word.endswith('ch') else 's'}" if count != 1 else f"1 {word}"


def counted(metrics, stage: str) -> str:
    """``1 batch, 3 sequences, 384 tokens``: what the last evaluation of ``stage`` read (its logged counts)."""
    counts = [metrics.get(metric_names.eval_count(stage, what)) for what in metric_names.EVAL_COUNTS]
    if any(count is None for count in counts):
        return "batches not counted"
    return ", ".join(plural(int(count), word) for count, word in zip(counts, ("batch", "sequence", "token"),
                                                                      strict=True))
