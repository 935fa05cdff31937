"""Suite-wide set-up: 8 fake CPU devices before JAX starts, absl flags for grain workers,
and a guard that ends a hung test's process with every thread's stack."""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Generator

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Helper modules that spawned worker processes import by name.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))

import grain_replay  # noqa: F401 - marks absl flags parsed for grain workers

# Seconds past a test's own timeout (pytest-timeout's) before the guard below ends it
# (tests/test_hang_guard.py sets a short one).
HANG_GRACE_S = float(os.environ.get("GRAIN_REPLAY_TEST_HANG_GRACE_S", "60"))
_stderr: list[int] = []  # the terminal's stderr, not the capture's


def pytest_configure(config: pytest.Config) -> None:
    if sys.__stderr__ is None:
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    try:
        _stderr.append(os.dup(sys.__stderr__.fileno()))
    finally:
        if capture is not None:
            capture.resume_global_capture()


def _timeout_of(item: pytest.Item) -> float:
    """The test's pytest-timeout limit in seconds (its mark, --timeout, the ini); 0: none."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        value = marker.args[0] if marker.args else marker.kwargs["timeout"]
    else:
        value = item.config.getoption("timeout", None)
        if value is None:
            try:
                value = item.config.getini("timeout")
            except ValueError:  # pytest-timeout not installed
                value = 0
    return float(value or 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """A hang past the test's timeout dumps every thread's stack and ends the process.

    pytest-timeout fails a test once, from a signal handler in the main thread; a test
    whose clean-up then waits again (a writer's close() draining a wedged thread), or
    whose main thread never runs Python again (waiting in C), is never ended, and an
    xdist worker sits idle until the whole CI run is killed, printing nothing (it did,
    once). faulthandler's watchdog is a C thread: it needs neither the GIL nor the main
    thread. xdist reports the ended worker as crashed in that test and goes on.
    """
    limit = _timeout_of(item)
    if limit <= 0 or not _stderr:
        return (yield)
    faulthandler.dump_traceback_later(limit + HANG_GRACE_S, exit=True, file=_stderr[0])
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
