"""The README as a newcomer follows it: its Python runs as written, twice, and its promises hold.

The Python blocks run in order, as one script, in an empty directory: twice, because
a newcomer runs the Quick start again. A block preceded by
``<!-- not run: REASON -->`` needs something this machine has not (an S3 endpoint);
it must still compile.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NOT_RUN = re.compile(r"<!-- not run: ([^>]+) -->\s*\n$")
# The only reasons a block may give for not running here: data or services from outside.
REASONS = {
    "needs an S3 endpoint and credentials": "s3://",
    "needs a LeRobot dataset from the Hugging Face Hub (tests/datasets/test_lerobot.py runs it "
    "on a toy one)": "LeRobotDataSource",
    "needs an RLDS dataset built by TFDS (tests/datasets/test_rlds_source.py runs it on a "
    "toy one)": "tensorflow_datasets/",
}


def _python_blocks() -> list[tuple[str, str | None]]:
    """(code, why it is not run or None) for every ```python block, in order."""
    blocks = []
    for m in re.finditer(r"```python\n(.*?)```", README, re.S):
        skip = NOT_RUN.search(README[: m.start()])
        blocks.append((m.group(1), skip.group(1).strip() if skip else None))
    return blocks


def _make_recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_readme_python_blocks_run_twice_from_an_empty_directory(tmp_path: Path):
    runnable = [code for code, why in _python_blocks() if why is None]
    assert len(runnable) >= 2
    (tmp_path / "readme_blocks.py").write_text("\n".join(runnable))
    # One interpreter runs the script twice, each time in a fresh namespace, as a
    # second `python readme_blocks.py` would (what it left on disk is what matters).
    runner = (
        "import runpy, sys\n"
        "for attempt in (1, 2):\n"
        "    print(f'--- run {attempt}', flush=True)\n"
        "    runpy.run_path(sys.argv[1], run_name='__main__')\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", runner, str(tmp_path / "readme_blocks.py")],
        cwd=work, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    second = proc.stdout.split("--- run 2")[1]
    assert "(256, 17) bool" in second  # the shapes the README's comments promise, on the rerun
    assert "(32, 17) (32,)" in second
    if shutil.which("git") is None:
        return
    # Everything the snippets write is covered by the repository's .gitignore.
    shutil.copy(ROOT / ".gitignore", work / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=work, capture_output=True, text=True, check=True,
    ).stdout.split("\n")  # fmt: skip
    assert [line for line in status if line] == ["?? .gitignore"], status


def test_blocks_that_do_not_run_say_why_and_compile():
    # The front door's snippets all run; the guide's pages hold the ones that cannot
    # (tests/test_docs_snippets.py checks those).
    skipped = [(code, why) for code, why in _python_blocks() if why is not None]
    for code, why in skipped:
        assert why in REASONS, f"a new reason is justified in REASONS: {why}"
        assert REASONS[why] in code, why
        ast.parse(code)
    assert len(skipped) < len(_python_blocks())


def test_readme_gives_expected_times_on_two_cores():
    table = re.search(r"\| command \(2 cores\) \|.*?\n\n", README, re.S)
    assert table, "the README's table of expected times is missing"
    rows = table.group(0)
    assert re.search(r"\| `make demo` \| ~\d+ min install \+ ~\d+ s \|", rows), rows
    assert re.search(r"\| `make test` \| .*~\d+(\.\d+)? min", rows), rows
    assert "Measured on a 2-core machine" in README


def test_the_guide_says_how_to_get_fake_devices_outside_make():
    for page in ("loader.md", "pitfalls.md"):
        text = (ROOT / "docs" / page).read_text()
        assert "XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python" in text
        assert "before JAX starts" in text


def test_the_readme_is_a_front_door():
    """What it is, install, the two commands, two quick starts, where to read next: short."""
    assert len(README.splitlines()) <= 300
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings[:4] == [
        "Install",
        "Quick start: offline",
        "Quick start: online (actors and a rate-limited learner)",
        "Where to read next",
    ], headings
    table = README.split("## Where to read next")[1].split("\n## ")[0]
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", table))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    # Every page of the guide but the upstream report and the site's home is one click away.
    assert pages - linked == {"docs/jax-gloo-exit-stall.md", "docs/index.md"}, pages - linked


def test_readme_states_the_demo_venv_size_measured_in_a_fresh_clone():
    assert re.search(r"\*\*\d+ MB\*\* in `\.venv/`", README)
    assert "make demo && du -sh .venv" in README


def test_install_announces_each_step_and_shows_pip_progress():
    recipe = _make_recipe("$(DEMO_STAMP)")
    echoes = [line for line in recipe if line.startswith("@echo")]
    assert len(echoes) >= 3
    assert any("[3/3]" in e and "minutes" in e for e in echoes), echoes
    (install,) = [line for line in recipe if "pip install" in line and "-e " in line]
    assert "--quiet" not in install and "-q " not in install
    assert install.endswith("-e ."), install  # the demo installs the package alone


def test_the_test_stamp_adds_the_extras_on_top_of_the_demo_stamp():
    lines = (ROOT / "Makefile").read_text().splitlines()
    (rule,) = [line for line in lines if line.startswith("$(STAMP):")]
    assert "$(DEMO_STAMP)" in rule.split(":", 1)[1]  # a fresh `make test` installs both
    recipe = _make_recipe("$(STAMP)")
    assert any("1 GB" in e and "minutes" in e for e in recipe if e.startswith("@echo")), recipe
    (install,) = [line for line in recipe if "pip install" in line and "-e " in line]
    assert "test" in install and "--quiet" not in install
    assert _make_recipe("demo")[0].endswith("grain_replay.cli demo")
    (demo_rule,) = [line for line in lines if line.startswith("demo:")]
    assert demo_rule.split(":", 1)[1].split() == ["$(DEMO_STAMP)"]


def test_pyproject_license_is_a_pep639_expression():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in project["build-system"]["requires"] if "setuptools" in r]
    assert setuptools == "setuptools>=77"  # the first setuptools that reads PEP 639 licenses


def test_ci_runs_exactly_the_readme_test_command_which_lists_the_slowest_tests():
    assert "make test   #" in README
    ci = (ROOT / ".ci" / "run").read_text()
    # One leg per interpreter, each the README's command: make test PYTHON=<interpreter>.
    runs = [line.strip() for line in ci.splitlines() if line.strip().startswith("make ")]
    assert runs == [
        'make -n test PYTHON="$2" || rc=$?',
        'make test PYTHON="$2" || rc=$?',
        "make -n docs || docs_rc=$?",
        "make docs || docs_rc=$?",
    ]
    # The site is built once, after the legs, and its failure fails CI.
    assert ci.index("make docs ||") > ci.index("leg default python3")
    assert 'failed+=("docs")' in ci
    assert "leg default python3" in ci and "leg newest" in ci and "SKIPPED" in ci
    assert "make test PYTHON=python3.13" in README
    (pytest_line,) = [line for line in _make_recipe("test") if "pytest" in line]
    assert "--durations=15" in pytest_line and '-m "not slow"' in pytest_line


@pytest.mark.parametrize("command", ["make demo", "make test", "make lint", "make docs"])
def test_readme_commands_exist_in_the_makefile(command: str):
    assert command in README
    _make_recipe(command.split()[1])
