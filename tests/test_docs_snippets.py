"""Every page of the user guide (docs/*.md) as a reader follows it: its Python runs as written.

Each page's Python blocks run in order, as one script, in an empty directory (the README's run
in tests/test_readme.py). A block preceded by ``<!-- not run: REASON -->`` needs something this
machine has not (a dataset from a hub, several processes); its reason must be one of REASONS,
name where that code is run instead, and the block must still compile. The script runs with
``__name__ == "__main__"`` but no file behind ``__main__``, as ``python -c`` does, so loader
workers spawned by a snippet do not run the page again.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOT_RUN = re.compile(r"<!-- not run: ([^>]+) -->\s*\n$")
# A reason, and what the block must contain for that reason to apply.
REASONS = {
    "needs a LeRobot dataset from the Hugging Face Hub (tests/datasets/test_lerobot.py runs it "
    "on a toy one)": "LeRobotDataSource",
    "needs an RLDS dataset built by TFDS (tests/datasets/test_rlds_source.py runs it on a "
    "toy one)": "tensorflow_datasets/",
    "needs an S3 endpoint and credentials": "s3://",
    "a two-process reproducer (tests/device/test_multihost_shutdown.py runs this job)": (
        "jax.distributed.initialize(f"
    ),
}
# What a page's script must print: the outputs its comments promise.
PRINTS = {
    "sources.md": ["10000 (3, 17) ()"],
    "sequences.md": ["(2, 8, 17)", "(2, 2, 17) (2, 16, 6) (2, 16)"],
    "datasets.md": ["1000 10 (16, 8)"],
    "pitfalls.md": ["8 (256, 17)", "refused: True\nrefused: True\n(32, 17)"],
    "checkpointing.md": ["{None: "],
}
# Set-up run before a page's script, in the same process (not part of what the page shows):
# resident replay's gather windows of 8 batches, not 64, in device_replay.md: that program
# compiles in a fraction of the time (~10 s less; the default window is compiled by
# tests/device/test_resident.py), and the page's batches are the same.
PRELUDE = {
    "device_replay.md": (
        "import grain_replay.device.resident as r\nr._MAX_WINDOW = min(r._MAX_WINDOW, 8)\n"
    ),
}
RUNNER = (
    "import sys\n"
    "exec(sys.argv[3], {})\n"
    "code = compile(open(sys.argv[1]).read(), sys.argv[2], 'exec')\n"
    "exec(code, {'__name__': '__main__'})\n"
)


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """(code, why it is not run or None) for every ```python block of a page, in order."""
    blocks = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        skip = NOT_RUN.search(text[: m.start()])
        blocks.append((m.group(1), skip.group(1).strip() if skip else None))
    return blocks


def _pages() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md") if python_blocks(p.read_text()))


def test_the_guide_has_pages_with_snippets() -> None:
    pages = _pages()
    assert len(pages) >= 10, pages
    assert set(PRINTS) <= set(pages)


@pytest.mark.parametrize("page", _pages())
def test_page_snippets_run_from_an_empty_directory(page: str, tmp_path: Path) -> None:
    blocks = python_blocks((DOCS / page).read_text())
    runnable = [code for code, why in blocks if why is None]
    if not runnable:
        pytest.skip(f"{page}: every block needs something from outside (checked below)")
    script = tmp_path / "page.py"
    script.write_text("\n".join(runnable))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script), f"docs/{page}", PRELUDE.get(page, "")],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"docs/{page}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    for want in PRINTS.get(page, []):
        assert want in proc.stdout, (page, want, proc.stdout)


def test_blocks_that_do_not_run_say_why_and_compile() -> None:
    seen = 0
    for page in sorted(DOCS.glob("*.md")):
        for code, why in python_blocks(page.read_text()):
            if why is None:
                continue
            seen += 1
            assert why in REASONS, f"{page.name}: a new reason is justified in REASONS: {why}"
            assert REASONS[why] in code, (page.name, why)
            ast.parse(code)
    assert seen >= 1


def test_the_runner_fails_a_page_whose_snippet_raises(tmp_path: Path) -> None:
    script = tmp_path / "page.py"
    script.write_text("raise SystemExit('a broken snippet')\n")
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script), "docs/x.md", ""],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "a broken snippet" in proc.stderr
