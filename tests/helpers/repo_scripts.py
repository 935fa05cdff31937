"""The repository's scripts (examples, benchmarks) loaded as modules by the tests that run them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """The script at ``path`` as a module (named ``name``, default ``example_<stem>``)."""
    spec = importlib.util.spec_from_file_location(name or f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as the module ``example_<name>``."""
    return load_script(EXAMPLES / f"{name}.py")
