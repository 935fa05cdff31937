"""pipeline/shutdown.py: what is still open is closed at exit, newest first, held weakly."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grain_replay.pipeline import shutdown

REPO = Path(__file__).resolve().parents[2]


class _Closeable:
    def __init__(self, registry: shutdown.Registry, log: list[str], name: str) -> None:
        self.registry, self.log, self.name = registry, log, name
        registry.register(self, _Closeable.close)

    def close(self) -> None:
        self.log.append(self.name)
        self.registry.unregister(self)


def test_close_all_closes_the_live_ones_newest_first() -> None:
    registry, log = shutdown.Registry(), []
    a, b, c = (_Closeable(registry, log, n) for n in "abc")
    b.close()  # closed by its user: not again at exit
    assert registry.live() == [a, c]
    registry.close_all()
    assert log == ["b", "c", "a"]
    assert registry.live() == []
    registry.close_all()  # idempotent: nothing left
    a.close()  # and the owners' own close still works
    assert log == ["b", "c", "a", "a"]


def test_registering_again_moves_an_owner_to_the_newest_place() -> None:
    registry, log = shutdown.Registry(), []
    a, b = _Closeable(registry, log, "a"), _Closeable(registry, log, "b")
    registry.register(a, _Closeable.close)
    assert registry.live() == [b, a]
    registry.close_all()
    assert log == ["a", "b"]


def test_the_registry_keeps_nothing_alive() -> None:
    registry, log = shutdown.Registry(), []
    a = _Closeable(registry, log, "a")
    assert registry.live() == [a]
    del a
    gc.collect()
    assert registry.live() == []
    registry.close_all()
    assert log == []


def test_a_failing_close_is_logged_and_the_others_still_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry, log = shutdown.Registry(), []

    def boom(_: object) -> None:
        raise OSError("disk gone")

    a = _Closeable(registry, log, "a")
    b = _Closeable(registry, log, "b")
    registry.register(b, boom)
    assert registry.live() == [a, b]
    registry.close_all()
    assert log == ["a"]
    assert "disk gone" in caplog.text
    assert registry.live() == []


def test_the_hook_runs_before_the_exit_handlers_of_later_imports() -> None:
    # atexit runs the last registered first: a register() after another library's
    # handler (jax's, at import) moves the hook ahead of it again.
    script = textwrap.dedent(
        """
        import atexit
        from grain_replay.pipeline import shutdown

        class Thing:
            def close(self):
                print("closed", flush=True)

        first = Thing()
        shutdown.register(first, Thing.close)
        atexit.register(print, "imported later", flush=True)  # e.g. jax's clean-up
        second = Thing()
        shutdown.register(second, Thing.close)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=60,
    ).stdout.split("\n")
    assert out[:3] == ["closed", "closed", "imported later"], out


def test_the_registry_does_not_import_jax() -> None:
    code = "import sys; import grain_replay.pipeline.shutdown; print('jax' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert out.stdout.strip() == "False"
