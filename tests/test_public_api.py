"""What the package declares to its users: ``__all__`` in every flexmoba module, and ``py.typed``
markers that ship in the wheel."""

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import flexmoba

REPO = Path(__file__).resolve().parents[1]
OPTIONAL = {"transformers"}


def flexmoba_modules():
    for info in pkgutil.walk_packages(flexmoba.__path__, prefix="flexmoba."):
        try:
            yield importlib.import_module(info.name)
        except ModuleNotFoundError as error:
            if error.name not in OPTIONAL:
                raise


@pytest.mark.parametrize("module", [flexmoba, *flexmoba_modules()], ids=lambda m: m.__name__)
def test_every_module_declares_its_public_names(module):
    assert isinstance(getattr(module, "__all__", None), list), f"{module.__name__} has no __all__ list"
    assert len(set(module.__all__)) == len(module.__all__), f"{module.__name__}.__all__ repeats a name"
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.__all__ names {name!r}, which it does not define"
        value = getattr(module, name)
        if module is not flexmoba and (inspect.isclass(value) or inspect.isfunction(value)):
            own = value.__module__ == module.__name__
            from_own_part = hasattr(module, "__path__") and value.__module__.startswith(module.__name__ + ".")
            assert own or from_own_part, f"{module.__name__}.__all__ re-exports {name!r} from {value.__module__}"


def test_every_module_is_covered():
    """The walk finds the modules users import, so the test above cannot pass on an empty list."""
    names = {m.__name__ for m in flexmoba_modules()}
    assert {"flexmoba.attention", "flexmoba.spec", "flexmoba.model", "flexmoba.integrations.export"} <= names


@pytest.mark.parametrize("package", ["flexmoba", "lit"])
def test_packages_are_marked_typed_and_ship_the_marker(package):
    tomllib = pytest.importorskip("tomllib")
    assert (REPO / package / "py.typed").is_file()
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data[package]
