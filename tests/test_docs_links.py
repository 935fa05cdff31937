"""No page refers to a file that does not exist.

Every relative link (``[text](path#anchor)``) and every backticked repository path
(```docs/x.md```, ```examples/y.py```, ```tests/z.py::Test```) in README.md, docs/*.md,
benchmarks/README.md, CHANGELOG.md's Unreleased section and SECURITY.md names a file or
folder of this repository; a link's ``#anchor`` names a heading of the page it points to.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
TICKED = re.compile(r"`([^`\s]+)`")
# A backticked word is a repository path when it starts with one of these.
TOP = ("docs/", "examples/", "benchmarks/", "tests/", "grain_replay/", ".ci/")
FILES = ("README.md", "CHANGELOG.md", "SECURITY.md", "Makefile", "mkdocs.yml", "pyproject.toml")


def _pages() -> dict[str, str]:
    tops = ("README.md", "benchmarks/README.md", "SECURITY.md")
    pages = {p: (ROOT / p).read_text() for p in tops}
    for p in sorted((ROOT / "docs").glob("*.md")):
        pages[f"docs/{p.name}"] = p.read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    unreleased = changelog.split("\n## Unreleased", 1)[1]
    pages["CHANGELOG.md (Unreleased)"] = re.split(r"\n## ", unreleased, maxsplit=1)[0]
    return pages


def _prose(text: str) -> str:
    """The page without its fenced code blocks (code is run by the snippet tests)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def slug(heading: str) -> str:
    """The anchor GitHub and mkdocs give a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", _prose(path.read_text()), re.M)}


def _links(page: str, text: str) -> list[tuple[Path, str]]:
    base = (ROOT / page.split(" ")[0]).parent
    out = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        out.append(((base / path).resolve(), anchor))
    return out


def _ticked(text: str) -> list[str]:
    out = []
    for word in TICKED.findall(_prose(text)):
        word = word.split("::")[0].rstrip(".,:;")
        if word.startswith(TOP) or word in FILES:
            if any(c in word for c in "<>*{}$"):  # a pattern (`docs/*.md`), not one path
                continue
            out.append(word)
    return out


@pytest.mark.parametrize("page", sorted(_pages()))
def test_every_relative_link_names_a_file_and_heading_that_exist(page: str) -> None:
    text = _pages()[page]
    for target, anchor in _links(page, text):
        where = target.relative_to(ROOT)
        assert target.exists(), f"{page}: a link to {where}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{page}: no heading #{anchor} in {target.name}"


@pytest.mark.parametrize("page", sorted(_pages()))
def test_every_backticked_repository_path_exists(page: str) -> None:
    missing = [w for w in _ticked(_pages()[page]) if not (ROOT / w).exists()]
    assert not missing, f"{page} names paths that do not exist: {missing}"


def test_the_checks_see_links_and_paths_and_catch_a_missing_one() -> None:
    pages = _pages()
    assert len(pages) >= 15
    readme = pages["README.md"]
    assert len(_links("README.md", readme)) >= 10 and "docs/pitfalls.md" in _ticked(
        "see `docs/pitfalls.md`"
    )
    ((target, anchor),) = _links("docs/x.md", "[a](nope.md#here)")
    assert not target.exists() and anchor == "here"
    assert _ticked("`examples/nope.py` and `docs/*.md` and `tests/a.py::T`") == [
        "examples/nope.py",
        "tests/a.py",
    ]
    assert slug("`flush(wait=False)`: a commit that does not stall the loop") == (
        "flushwaitfalse-a-commit-that-does-not-stall-the-loop"
    )
