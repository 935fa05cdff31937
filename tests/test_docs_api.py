"""docs/api.md lists every ``gr.*`` name, each entry the object the name is; mkdocs.yml builds it.

Runs without mkdocs (``make docs`` renders the page; this only reads it), so a name added to
``grain_replay.__all__`` without its API entry fails ``make test``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import grain_replay as gr

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^::: ([\w.]+)\s*$", re.M)


def _entries() -> list[str]:
    return ENTRY.findall((ROOT / "docs" / "api.md").read_text())


def _resolve(path: str) -> object:
    """The object a mkdocstrings identifier names: the longest importable module, then attrs."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"docs/api.md: nothing importable in {path!r}")


def test_every_public_name_has_one_entry_and_no_other_is_listed() -> None:
    entries = _entries()
    names = [e.rsplit(".", 1)[1] for e in entries]
    public = sorted(set(gr.__all__) - {"__version__"})
    assert len(names) == len(set(names)), "an entry appears twice"
    missing = sorted(set(public) - set(names))
    extra = sorted(set(names) - set(public))
    assert not missing and not extra, (
        f"docs/api.md lacks {missing} and lists {extra}, which are not gr.* names. Fix: one "
        "`::: module.Name` line per name of grain_replay.__all__ (the module that defines it)."
    )


def test_every_entry_is_the_object_its_public_name_is() -> None:
    for entry in _entries():
        name = entry.rsplit(".", 1)[1]
        assert _resolve(entry) is getattr(gr, name), entry


def test_mkdocs_builds_the_api_page_strictly_from_docs() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^strict: true$", config, re.M)
    assert re.search(r"^docs_dir: docs$", config, re.M)
    assert "mkdocstrings" in config and "api.md" in config
    # Every page of the guide is in the navigation (a page left out is not browsable).
    nav = set(re.findall(r":\s*([\w-]+\.md)\s*$", config, re.M))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == nav, (sorted(pages - nav), sorted(nav - pages))


def test_make_docs_builds_strictly_in_its_own_venv() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\ndocs: ") :].split("\n\n")[0]
    assert "$(DOCS_STAMP)" in recipe.split("\n")[1]
    assert "mkdocs build --strict" in recipe and "site" in recipe
    assert "DOCS_VENV ?= .venv-docs" in makefile
    assert '["docs"]' in makefile  # the docs extra of pyproject.toml, nothing else
    assert ".venv-docs/" in (ROOT / ".gitignore").read_text().split()
    assert "/site/" in (ROOT / ".gitignore").read_text().split()


def test_the_docs_extra_has_no_upper_pins() -> None:
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["docs"]
    joined = " ".join(extra)
    assert "mkdocs-material" in joined and "mkdocstrings[python]" in joined
    assert "<" not in joined and "==" not in joined, extra
