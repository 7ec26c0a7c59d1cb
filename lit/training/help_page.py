"""The ``flexmoba fit`` help page: flexmoba's option groups first (the run's own, the model's training and
architecture, the default data module's, checkpoints, the divergence guard, predictions), Lightning's after
them, each under a title that says what it is (:meth:`lit.training.launch.LauncherParser.format_help`)."""

from __future__ import annotations

import dataclasses

from flexmoba.model import ModelConfig
from lit.training.data import ByteFilesData

LIGHTNINGS = ("trainer", "optimizer", "lr_scheduler", "links")
# flexmoba's help groups in the order shown: the general options, the subcommand's own (--ckpt_path), the model
# (its architecture after it), the data (the default module's options after it), the guards and checkpoints.
HELP_ORDER = ("", "help", "ckpt_path", "model", "data", "divergence_guard", "predictions", "checkpoint")
HELP_TITLES = {
    "model": "The model's training (--model.*)",
    "checkpoint": "Checkpoints (--checkpoint.*)",
    "divergence_guard": "The divergence guard (--divergence_guard.*)",
    "predictions": "Predictions (--predictions.*, predict only)",
    "data": "The data module (--data CLASS_PATH; the default: lit.training.data.ByteFilesData)",
    "ckpt_path": "The checkpoint (--ckpt_path last: the run folder's newest; or a path)",
    "trainer": "Lightning's options from here on. The Trainer (--trainer.*)",
}


def short_usage(prog: str) -> str:
    """``flexmoba [options] fit [--config FILE] [--OPTION VALUE ...]``: one line, not one naming every option."""
    return f"{prog} [--config FILE] [--OPTION VALUE ...]"


def group_key(group) -> str:
    """What a help group is about: its ``dest`` (``model``), else the top key of its first option
    (``trainer``, ``data``, ``optimizer``; ``help`` for the general options)."""
    dest = getattr(group, "dest", None)
    if dest:
        return dest
    if group.title == "Linked arguments":
        return "links"
    actions = getattr(group, "_group_actions", [])
    return actions[0].dest.split(".")[0] if actions else ""


def is_lightnings(group) -> bool:
    """Whether a help group holds Lightning's options (the Trainer's, optimizer's, LR scheduler's, links)."""
    return group_key(group).split(".")[0] in LIGHTNINGS


def help_groups(cls, prefix: str, titles: dict[str, str], defaults: dict | None = None) -> list:
    """The help groups of ``cls``'s arguments under ``prefix`` (a throwaway parser's), titled by ``titles``
    (group dest -> title), showing ``defaults`` (dest -> value) where given."""
    from jsonargparse import ArgumentParser

    helper = ArgumentParser(prog="flexmoba")
    helper.add_class_arguments(cls, prefix)
    groups = []
    for group in helper._action_groups:
        if getattr(group, "dest", None) not in titles:
            continue
        group.title = titles[group.dest]
        group._group_actions = [action for action in group._group_actions if action.dest != group.dest]
        for action in group._group_actions:
            if defaults and action.dest in defaults:
                action.default, action.required = defaults[action.dest], False
        groups.append(group)
    return groups


def flattened(values: dict, prefix: str) -> dict:
    """``{"a": {"b": 1}}`` as ``{"<prefix>.a.b": 1, "<prefix>.a": {...}}``."""
    flat = {}
    for key, value in values.items():
        flat[f"{prefix}.{key}"] = value
        if isinstance(value, dict):
            flat.update(flattened(value, f"{prefix}.{key}"))
    return flat


def field_defaults(cls) -> dict:
    """A dataclass's declared defaults (``None`` where ``__post_init__`` derives a value), nested ones as dicts."""
    values = {}
    for field in dataclasses.fields(cls):
        value = field.default if field.default is not dataclasses.MISSING else (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
        values[field.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return values


def model_config_groups() -> list:
    return help_groups(ModelConfig, "model.config", {
        "model.config": "The model's architecture (--model.config.*; the defaults are the project's default model)",
        "model.config.moba": "MoBA (--model.config.moba.*)"},
        flattened(field_defaults(ModelConfig), "model.config"))


def data_groups() -> list:
    return help_groups(ByteFilesData, "data", {
        "data": f"The data (--data.*) of {ByteFilesData.__module__}.{ByteFilesData.__name__}, the default data "
                "module (another module's: --data.help CLASS_PATH)"})


HELP_EXTRAS = {"model": model_config_groups, "data": data_groups}  # shown right after the group they belong to
