"""The one launcher: fit, compare and sweep all build their Trainer through FlexMobaCLI.instantiate_trainer,
which fixes glibc's malloc thresholds for runs on CPU."""

import sys
from pathlib import Path

import pytest
import yaml

from lit.experiments import compare, sweep
from lit.training import launch

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs"
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


@pytest.fixture
def trainers_built(monkeypatch):
    """The ``default_root_dir`` of every Trainer the launcher builds, in order, each followed by
    ``"kept"`` where the launcher fixed the malloc thresholds while building it."""
    built = []
    original = launch.FlexMobaCLI.instantiate_trainer

    def spy(self, **kwargs):
        trainer = original(self, **kwargs)
        built.append(Path(trainer.default_root_dir))
        return trainer

    monkeypatch.setattr(launch.FlexMobaCLI, "instantiate_trainer", spy)
    monkeypatch.setattr(launch, "keep_freed_memory", lambda: built.append("kept"))
    monkeypatch.setattr(sys, "argv", ["flexmoba"])
    return built


def tiny(cache: Path) -> list[str]:
    return ["--config", str(CONFIGS / "moba.yaml"), "--config", str(CONFIGS / "tiny.yaml"), "--trainer.max_steps", "1",
            "--data.cache_dir", str(cache), *QUIET]


@pytest.mark.slow
def test_fit_compare_and_sweep_build_their_trainers_through_the_launcher(tmp_path, corpus_cache, trainers_built):
    launch.run_cli(["fit", *tiny(corpus_cache), "--trainer.default_root_dir", str(tmp_path / "fit")])
    assert trainers_built == ["kept", tmp_path / "fit"]

    compare.main([*tiny(corpus_cache), "--final_val_batches", "1", "--out", str(tmp_path / "compare")])
    assert trainers_built[2:] == ["kept", tmp_path / "compare" / "moba" / "seed1337",
                                  "kept", tmp_path / "compare" / "full" / "seed1337"]

    spec = {"out_dir": str(tmp_path / "sweep"), "seq_len": 128, "batch_size": 2, "tokens_per_parameter": 0.0,
            "min_steps": 1, "position_window": 32, "trailing_window": 32, "limit_val_batches": 1,
            "base_config": str(CONFIGS / "moba.yaml"), "sizes": [{"name": "a", "n_layers": 1, "d_model": 16,
                                                                    "n_heads": 2}],
            "attention": {"full": {"attention": "full"}},
            "cli_args": ["--config", str(CONFIGS / "tiny.yaml"), "--data.cache_dir", str(corpus_cache), *QUIET]}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    sweep.main([str(tmp_path / "sweep.yaml")])
    assert trainers_built[6:] == ["kept", tmp_path / "sweep" / "a-full"]
