"""The suite's hang guard (tests/conftest.py): a test still running past its timeout (after
pytest-timeout failed it once) ends its process with every thread's stack on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_test_that_hangs_past_its_timeout_ends_with_every_threads_stack(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_wedged.py").write_text(
        textwrap.dedent(
            """
            import threading

            def _wedged_thread():
                threading.Event().wait()

            def test_waits_again_after_its_timeout():
                threading.Thread(target=_wedged_thread, daemon=True).start()
                try:
                    threading.Event().wait(120)  # pytest-timeout fails it here, once
                finally:
                    threading.Event().wait(120)  # the clean-up waits again: the guard ends it
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRAIN_REPLAY_TEST_HANG_GRACE_S": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "tests.conftest",
         "-p", "no:cacheprovider", "--timeout=1", "--rootdir", str(tmp_path),
         str(tmp_path / "test_wedged.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Timeout (0:00:02)!" in proc.stderr, proc.stderr
    assert "in _wedged_thread" in proc.stderr, "the other threads' stacks are missing"
    assert "in test_waits_again_after_its_timeout" in proc.stderr, proc.stderr
