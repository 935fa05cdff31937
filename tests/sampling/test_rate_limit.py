"""Samples-per-insert rate limits: options, refusals, both sides' waits, timeouts, restore."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sampling.rate import limit as rate_limit
from grain_replay.store import progress as learners_lib
from grain_replay.writers import rate_wait

HELPERS = Path(__file__).parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))
from parts_child import check_rows, make_rows  # noqa: E402
from rate_writer import run_learner, run_writer  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")


def _store(path: str, rows: int, writer_id: str = "seed", capacity: int = 100_000) -> None:
    with gr.ReplayWriter(
        path, "npy", capacity=capacity, writer_id=writer_id, segment_rows=4096
    ) as w:
        w.append(make_rows(writer_id, 0, rows))


def _loader(path: str, batch_size: int = 8, **options: Any) -> Any:
    return gr.make_data_loader(
        gr.open_source(path),
        batch_size=batch_size,
        num_epochs=None,
        sampling=gr.UniformReplay(**options),
    )


def _inserted(path: str) -> int:
    return learners_lib.InsertedCount(path).read()[0]


def _wait_file(path: str, timeout: float = 60.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end, f"no {path} after {timeout} s"
        time.sleep(0.02)
    with open(path) as f:
        out: dict[str, Any] = json.load(f)
    return out


# -- options and refusals ------------------------------------------------------------------


@pytest.mark.parametrize("cls", [gr.UniformReplay, gr.PrioritizedReplay])
@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"min_size": -1}, "min_size must be >= 0"),
        ({"min_size": 1.5}, "min_size must be an int"),
        ({"samples_per_insert": 0}, "samples_per_insert must be a positive"),
        ({"samples_per_insert": -2.0}, "samples_per_insert must be a positive"),
        ({"samples_per_insert": float("nan")}, "samples_per_insert must be a positive"),
        ({"samples_per_insert": "8"}, "samples_per_insert must be a number"),
        ({"tolerance": 10}, "samples_per_insert is None"),
        ({"samples_per_insert": 1, "tolerance": -1}, "tolerance must be a finite"),
        ({"timeout": 0}, "timeout must be positive"),
        ({"timeout": True}, "timeout must be a number"),
    ],
)
def test_options_refuse_bad_values(cls: Any, kwargs: dict[str, Any], phrase: str) -> None:
    with pytest.raises(gr.InvalidSamplingError, match=phrase) as info:
        cls(**kwargs)
    assert isinstance(info.value, ValueError)
    assert cls.__name__ in str(info.value)


def test_options_normalize_numbers() -> None:
    opt = gr.PrioritizedReplay(
        min_size=np.int64(5), samples_per_insert=np.float32(2), tolerance=3, timeout=1
    )
    assert (opt.min_size, opt.samples_per_insert, opt.tolerance, opt.timeout) == (5, 2.0, 3.0, 1.0)
    assert type(opt.min_size) is int and type(opt.samples_per_insert) is float


def test_tolerance_below_one_batch_is_refused_when_built(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 64)
    with pytest.raises(gr.InvalidSamplingError, match=r"tolerance of 20 rows.*batches of 32") as e:
        _loader(path, batch_size=32, samples_per_insert=1.0, tolerance=20)
    assert "tolerance >= 32" in str(e.value)
    # one row's samples must fit too: (B + r) / 2
    with pytest.raises(gr.InvalidSamplingError, match="tolerance >= 50"):
        _loader(path, batch_size=32, samples_per_insert=68.0, tolerance=40)
    assert not os.path.exists(os.path.join(path, "learners"))


def test_min_size_beyond_every_writers_capacity_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 10, "a", capacity=50)
    _store(path, 10, "b", capacity=70)
    with pytest.raises(gr.InvalidSamplingError, match=r"keep at most 120 rows.*min_size <= 120"):
        _loader(path, min_size=121)
    _loader(path, min_size=120)  # possible: accepted


def test_mixture_and_static_source_refuse_rate_limits(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 20)
    src = gr.open_source(path)
    with pytest.raises(gr.InvalidSamplingError, match="mixture"):
        gr.make_data_loader(
            {"a": src, "b": src},
            weights={"a": 1, "b": 1},
            batch_size=4,
            num_epochs=None,
            sampling=gr.UniformReplay(samples_per_insert=1.0),
        )

    class Static:
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> Any:
            return {"x": np.int64(i)}

        def read_batch(self, rows: Any) -> Any:
            return {"x": np.asarray(rows, np.int64)}

    with pytest.raises(gr.InvalidSamplingError, match=r"holds 10 rows and cannot grow"):
        gr.make_data_loader(
            Static(), batch_size=2, num_epochs=None, sampling=gr.UniformReplay(min_size=11)
        )


# -- the learner waits -----------------------------------------------------------------------


def test_learner_waits_for_min_size_and_times_out(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 30)
    it = iter(_loader(path, min_size=40, timeout=0.3))
    t = time.monotonic()
    with pytest.raises(gr.RateLimitTimeoutError) as e:
        next(it)
    assert time.monotonic() - t >= 0.3
    assert isinstance(e.value, TimeoutError) and isinstance(e.value, gr.GrainReplayError)
    msg = str(e.value)
    assert "inserted 30 rows (30 live)" in msg and "min_size=40" in msg and "Fix:" in msg
    # ten more rows: the same iterator goes on, drawing from all 40
    _store(path, 10, "late")
    batch = next(it)
    check_rows(batch)


def test_learner_ceiling_and_timeout_message(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 20)
    # r=2, m=10, e=16: ceiling 2 * (20 - 10) + 16 = 36 rows: 4 batches of 8
    it = iter(_loader(path, min_size=10, samples_per_insert=2.0, tolerance=16, timeout=0.2))
    for _ in range(4):
        next(it)
    with pytest.raises(gr.RateLimitTimeoutError) as e:
        next(it)
    msg = str(e.value)
    for part in ("inserted 20 rows", "handed out 32 rows", "samples_per_insert=2", "allow 36"):
        assert part in msg, msg
    _store(path, 2, "more")  # 2 * 12 + 16 = 40: one more batch
    next(it)


def test_workers_prefetch_never_draws_past_the_ceiling(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 24)
    # ceiling 1 * 24 + 16 = 40 rows: 5 batches; the workers want 4 draws ahead
    loader = gr.make_data_loader(
        gr.open_source(path),
        batch_size=8,
        num_epochs=None,
        worker_count=2,
        sampling=gr.UniformReplay(samples_per_insert=1.0, tolerance=16, timeout=0.5),
    )
    it = iter(loader)
    try:
        for _ in range(5):
            check_rows(next(it))
        time.sleep(0.1)
        p = learners_lib.read_progress(os.path.join(path, "learners"), "process-0-of-1.json")
        assert p is not None and p.drawn == 40 and p.sampled == 40
        with pytest.raises(gr.RateLimitTimeoutError):
            next(it)
        _store(path, 8, "more")  # 8 more rows: one more batch
        check_rows(next(it))
    finally:
        it.close()
    assert not os.listdir(os.path.join(path, "learners"))  # withdrawn on close


def test_waiting_sides_log_why(tmp_path: Path, monkeypatch: Any, caplog: Any) -> None:
    monkeypatch.setattr(rate_limit, "LOG_EVERY_S", 0.05)
    monkeypatch.setattr(rate_wait, "LOG_EVERY_S", 0.05)
    path = str(tmp_path / "s")
    _store(path, 8)
    it = iter(_loader(path, samples_per_insert=1.0, tolerance=8, timeout=0.4))
    next(it)  # 8 <= 1 * 8 + 8
    next(it)  # 16 <= 16
    with caplog.at_level(logging.WARNING), pytest.raises(gr.RateLimitTimeoutError):
        next(it)
    lines = [r for r in caplog.records if r.name == "grain_replay.sampling.rate.limit"]
    assert 3 <= len(lines) <= 12, len(lines)  # one per (shortened) interval
    assert "the learner waited" in lines[0].getMessage()
    caplog.clear()
    # the writer side: 2 batches handed out and drawn (16 rows), 8 rows inserted
    w = gr.ReplayWriter(path, "npy", capacity=1000, writer_id="w", rate_limit_timeout=0.4)
    w.append(make_rows("w", 0, 8))
    w.flush()  # 1 * (8 + 8) - 16 = 0 <= 8: no wait
    w.append(make_rows("w", 8, 9))  # 1 * (16 + 9) - 16 = 9 > 8, the learner can draw: waits
    with caplog.at_level(logging.WARNING), pytest.raises(gr.RateLimitTimeoutError) as e:
        w.flush()
    lines = [r for r in caplog.records if r.name == "grain_replay.writers.rate_wait"]
    assert 3 <= len(lines) <= 12, len(lines)
    msg = str(e.value)
    assert "writer 'w'" in msg and "16 rows inserted and 9 more pending" in msg
    assert "handed out 16 rows" in msg and "Fix:" in msg
    assert w.committed == 8  # the rows stay pending
    it.close()  # the learner withdraws: the writer goes on
    assert w.flush() == 17
    w.close()


def test_writer_rate_limit_timeout_is_checked(tmp_path: Path) -> None:
    with pytest.raises(gr.InvalidArgumentError, match="rate_limit_timeout"):
        gr.ReplayWriter(str(tmp_path / "s"), "npy", writer_id="w", rate_limit_timeout=-1)


# -- real writer processes ------------------------------------------------------------------


def _band(path: str, it: Any, batches: int, r: float, m: int, e: float, slack: float) -> int:
    """Iterates ``batches`` batches, checking the ceiling after each and the floor once
    caught up; returns the batch at which the learner caught up."""
    caught = -1
    for k in range(batches):
        check_rows(next(it))
        handed = (k + 1) * 8
        inserted = _inserted(path)  # read after: only grows
        assert handed <= r * (inserted - m) + e, (k, handed, inserted)
        gap = r * (inserted - m) - handed
        if caught < 0 and gap <= e:
            caught = k
        if caught >= 0:
            assert gap <= e + slack, (k, handed, inserted, gap)
    return caught


def test_fast_learner_waits_for_a_slow_writer_process(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 16)
    report = str(tmp_path / "report.json")
    proc = SPAWN.Process(target=run_writer, args=(path, "actor", 4, 60, 0.01, report))
    proc.start()
    try:
        it = iter(_loader(path, min_size=16, samples_per_insert=2.0, timeout=60))
        caught = _band(path, it, 50, 2.0, 16, 16.0, 0.0)
        assert caught >= 0
        it.close()
        out = _wait_file(report)
        assert out["error"] is None and out["committed"] == 240
        assert out["wait_s"] < 1.0  # the learner was the one waiting
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def test_fast_writer_process_is_held_back_in_flush(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 16)
    r, m, e = 1.0, 16, 16.0
    it = iter(_loader(path, min_size=m, samples_per_insert=r, tolerance=e, timeout=60))
    next(it)  # the learner's first batch: from now on the writers wait for it
    report = str(tmp_path / "report.json")
    proc = SPAWN.Process(target=run_writer, args=(path, "actor", 8, 150, 0.0, report))
    proc.start()
    try:
        _band_from(path, it, 1, 10, r, m, e, slack=0.0)
        time.sleep(2.0)  # the learner pauses; the writer runs ahead until the floor
        handed = 10 * 8
        # it may commit 8 more rows while r * (inserted + 8 - m) - handed <= e: it stops
        # exactly at r * (inserted - m) - handed == e
        assert _inserted(path) == handed + m + e
        it.close()  # the learner goes: the writer finishes
        out = _wait_file(report)
        assert out["error"] is None and out["committed"] == 1200
        assert out["wait_s"] > 0.5 and out["flush_s"] >= out["wait_s"]
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def test_writer_process_times_out_and_names_the_numbers(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 16)
    it = iter(_loader(path, min_size=16, samples_per_insert=1.0, tolerance=16))
    next(it)
    report = str(tmp_path / "report.json")
    proc = SPAWN.Process(target=run_writer, args=(path, "actor", 8, 10, 0.0, report, 1000, 0.3))
    proc.start()
    try:
        out = _wait_file(report)
        assert out["error"][0] == "RateLimitTimeoutError"
        assert "samples_per_insert" in out["error"][1] and "rate_limit_timeout" in out["error"][1]
        # three flushes: 1 * (16 + 24 - 16) - 8 = 16 <= 16; a fourth: 24 > 16
        assert out["committed"] == 24
    finally:
        proc.join(60)
        it.close()


def test_dead_learner_does_not_hold_writers(tmp_path: Path, caplog: Any) -> None:
    path = str(tmp_path / "s")
    _store(path, 32)  # ceiling 32 - 16 + 16: the learner, at 2 batches, could draw more
    ready = str(tmp_path / "ready.json")
    opts = {"min_size": 16, "samples_per_insert": 1.0, "tolerance": 16}
    proc = SPAWN.Process(target=run_learner, args=(path, 2, opts, ready))
    proc.start()
    try:
        pid = _wait_file(ready)["pid"]
        w = gr.ReplayWriter(path, "npy", writer_id="w", rate_limit_timeout=0.3)
        w.append(make_rows("w", 0, 40))
        with pytest.raises(gr.RateLimitTimeoutError):  # the live learner holds it
            w.flush()
        os.kill(pid, signal.SIGKILL)
        proc.join(30)
        with caplog.at_level(logging.WARNING):
            assert w.flush() == 40
        assert any("has exited" in r.getMessage() for r in caplog.records)
        w.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def _publish_other_learner(
    path: str,
    *,
    sampled: int,
    tolerance: float,
    stale_after: float,
    pid: int,
    name: str = "process-0-of-1.json",
    host: str | None = None,
    token: str = "",
) -> None:
    """Publishes the progress of a learner on another host, heartbeat now, into ``path``."""
    progress = learners_lib.Progress(
        name=name,
        sampled=sampled,
        drawn=8,
        batch=8,
        samples_per_insert=1.0,
        tolerance=tolerance,
        min_size=0,
        heartbeat=time.time(),
        stale_after=stale_after,
        pid=pid,
        host=socket.gethostname() + "-other" if host is None else host,
        token=token,
    )
    learners_lib.publish(os.path.join(path, "learners"), progress)


def test_stale_learner_on_another_host_does_not_hold_writers(tmp_path: Path, caplog: Any) -> None:
    path = str(tmp_path / "s")
    _store(path, 16)
    _publish_other_learner(path, sampled=0, tolerance=8.0, stale_after=0.5, pid=1)
    w = gr.ReplayWriter(path, "npy", writer_id="w", rate_limit_timeout=0.2)
    w.append(make_rows("w", 0, 20))
    with pytest.raises(gr.RateLimitTimeoutError):
        w.flush()
    time.sleep(0.6)
    with caplog.at_level(logging.WARNING):
        assert w.flush() == 20
    assert any("heartbeat is" in r.getMessage() for r in caplog.records)
    w.close()


# -- checkpoints --------------------------------------------------------------------------


def test_counters_restore_exactly(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 24)
    opts = {"samples_per_insert": 1.0, "tolerance": 16.0, "timeout": 0.2}
    # ceiling 24 + 16 = 40 rows: 5 batches
    it = iter(_loader(path, **opts))
    for _ in range(3):
        next(it)
    state = it.get_state()
    saved = json.loads(state)
    assert saved["version"] == 3
    assert saved["rate_limit"]["sampled"] == 24 and saved["rate_limit"]["batch"] == 8
    rest = [next(it) for _ in range(2)]
    with pytest.raises(gr.RateLimitTimeoutError):
        next(it)
    it.close()

    again = iter(_loader(path, **opts))
    again.set_state(state)
    for want in rest:  # the same two batches, then the same ceiling
        np.testing.assert_array_equal(next(again)["seq"], want["seq"])
    with pytest.raises(gr.RateLimitTimeoutError):
        next(again)
    p = learners_lib.read_progress(os.path.join(path, "learners"), "process-0-of-1.json")
    assert p is not None and p.sampled == 40
    again.close()

    # a version-2 state (before rate limits) counts its position's batches
    old = dict(saved)
    del old["rate_limit"]
    old["version"] = 2
    third = iter(_loader(path, **opts))
    third.set_state(json.dumps(old).encode())
    next(third)
    next(third)
    with pytest.raises(gr.RateLimitTimeoutError):
        next(third)
    third.close()

    bad = dict(saved, rate_limit=dict(saved["rate_limit"], sampled=8))
    with pytest.raises(gr.ReplayCheckpointError, match="counted 8 rows"):
        iter(_loader(path, **opts)).set_state(json.dumps(bad).encode())


def test_prioritized_plain_store_holds_its_writer(tmp_path: Path) -> None:
    path = str(tmp_path / "plain")
    w = gr.ReplayWriter(path, "npy", rate_limit_timeout=0.2)
    w.append(make_rows("p", 0, 40))
    w.flush()
    it = iter(
        gr.make_data_loader(
            gr.open_source(path),
            batch_size=8,
            num_epochs=None,
            sampling=gr.PrioritizedReplay(samples_per_insert=0.5, tolerance=8, timeout=0.2),
        )
    )
    batch = next(it)  # ceiling 0.5 * 40 + 8 = 28 rows
    assert isinstance(batch, gr.Sampled)
    next(it)
    time.sleep(0.05)
    assert os.path.isfile(path + ".learners/process-0-of-1.json")
    # 0.5 * (40 + 30) - 16 = 19 > 8, and the learner could draw a third batch: waits
    w.append(make_rows("p", 40, 30))
    with pytest.raises(gr.RateLimitTimeoutError, match="30 more pending"):
        w.flush()
    assert len(gr.open_source(path)) == 40
    w.close()  # close commits without waiting
    assert len(gr.open_source(path)) == 70
    next(it)
    it.close()
    assert not os.listdir(path + ".learners")


def test_second_live_learner_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 64)
    _publish_other_learner(path, sampled=8, tolerance=16.0, stale_after=60.0, pid=4242)
    # refused when the loader is built: from then on it would hold the writers
    with pytest.raises(gr.InvalidSamplingError, match=r"another rate-limited learner.*pid 4242"):
        _loader(path, samples_per_insert=1.0)
    # without a ratio nothing is published: no conflict
    next(iter(_loader(path, min_size=8)))


def test_second_learner_in_the_same_process_is_refused_and_removes_nothing(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "s")
    learners = os.path.join(path, "learners")
    _store(path, 20)
    opts = {"min_size": 20, "samples_per_insert": 1.0, "tolerance": 8, "timeout": 0.2}
    loader = _loader(path, batch_size=4, **opts)
    first = iter(loader)  # ceiling 1 * (20 - 20) + 8: 2 batches
    next(first)
    time.sleep(0.05)
    mine = learners_lib.read_progress(learners, "process-0-of-1.json")
    assert mine is not None and mine.sampled == 4 and len(mine.token) == 16
    w = gr.ReplayWriter(path, "npy", capacity=1000, writer_id="w", rate_limit_timeout=0.2)
    w.append(make_rows("w", 0, 72))  # 1 * (20 + 72 - 20) - 4 = 68 > 8: waits
    assert w.rate_limit_wait_s == 0.0
    with pytest.raises(gr.RateLimitTimeoutError):
        w.flush()
    assert 0.2 <= w.rate_limit_wait_s < 5  # a flush that timed out waited too
    with pytest.raises(gr.InvalidSamplingError) as e:
        _loader(path, batch_size=4, **opts)  # refused when built
    msg = str(e.value)
    for part in (
        "in this process",
        f"pid {os.getpid()} on {socket.gethostname()!r}",
        "UniformReplay learner #",
        f"token {mine.token}",
        "Fix: close() the other",
    ):
        assert part in msg, msg
    assert isinstance(e.value, ValueError)
    # a second iterator of the first loader is refused before its first draw
    second = iter(loader)
    with pytest.raises(gr.InvalidSamplingError, match="in this process"):
        next(second)
    with pytest.raises(gr.InvalidSamplingError):  # still refused, nothing drawn meanwhile
        next(second)
    second.close()
    del second
    again = learners_lib.read_progress(learners, "process-0-of-1.json")
    assert again is not None and again.token == mine.token  # the first one's file stays
    with pytest.raises(gr.RateLimitTimeoutError):  # and still holds the writer
        w.flush(wait=False)
    assert w.committed == 0 and w.rate_limit_wait_s >= 0.4  # both timeouts counted
    # withdraw removes only the file holding its token
    assert not learners_lib.withdraw(learners, "process-0-of-1.json", "not-" + mine.token)
    assert not learners_lib.withdraw(learners, "process-0-of-1.json", "")
    assert os.path.isfile(os.path.join(learners, "process-0-of-1.json"))
    first.close()
    assert w.flush() == 72
    w.close()
    third = iter(_loader(path, batch_size=4, **opts))  # the first is closed: accepted
    next(third)
    third.close()


def test_learner_of_another_process_count_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 64)
    _publish_other_learner(
        path, sampled=8, tolerance=16.0, stale_after=60.0, pid=4343, name="process-1-of-2.json"
    )
    with pytest.raises(gr.InvalidSamplingError, match=r"process-1-of-2\.json.*pid 4343"):
        _loader(path, samples_per_insert=1.0)


def test_dropped_learner_and_leftover_file_of_this_pid_are_taken_over(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    learners = os.path.join(path, "learners")
    _store(path, 64)
    # a file with this pid whose token no publisher of this process holds: a leftover
    _publish_other_learner(
        path, sampled=8, tolerance=16.0, stale_after=60.0, pid=os.getpid(),
        host=socket.gethostname(), token="leftover",
    )  # fmt: skip
    first = iter(_loader(path, samples_per_insert=1.0))
    next(first)
    p = learners_lib.read_progress(learners, "process-0-of-1.json")
    assert p is not None and p.token not in ("", "leftover")
    # a learner dropped in a reference cycle (not collected yet) is not in the way
    cycle: list[Any] = [first]
    cycle.append(cycle)
    del first, cycle
    second = iter(_loader(path, samples_per_insert=1.0))
    next(second)
    q = learners_lib.read_progress(learners, "process-0-of-1.json")
    assert q is not None and q.token != p.token
    second.close()
    assert not os.listdir(learners)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_band_holds_with_two_writer_processes_over_a_longer_run(
    tmp_path: Path, workers: int
) -> None:
    path = str(tmp_path / "s")
    _store(path, 64)
    r, m, e, block = 2.0, 64, 32.0, 4
    reports = [str(tmp_path / f"r{i}.json") for i in range(2)]
    procs = [
        SPAWN.Process(target=run_writer, args=(path, f"a{i}", block, 400, 0.002, reports[i]))
        for i in range(2)
    ]
    loader = gr.make_data_loader(
        gr.open_source(path),
        batch_size=8,
        num_epochs=None,
        worker_count=workers,
        sampling=gr.UniformReplay(min_size=m, samples_per_insert=r, tolerance=e, timeout=120),
    )
    it = iter(loader)
    next(it)
    for p in procs:
        p.start()
    try:
        # two writers may commit at once, each after checking: r * block rows apart
        _band_from(path, it, 1, 600, r, m, e, slack=r * block)
        it.close()
        for rep in reports:
            out = _wait_file(rep, 120)
            assert out["error"] is None and out["committed"] == 1600
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def _band_from(
    path: str, it: Any, start: int, batches: int, r: float, m: int, e: float, slack: float
) -> None:
    for k in range(start, batches):
        check_rows(next(it))
        handed = (k + 1) * 8
        inserted = _inserted(path)
        assert handed <= r * (inserted - m) + e, (k, handed, inserted)
        assert r * (inserted - m) - handed <= e + slack, (k, handed, inserted)


def test_prioritized_over_a_bounded_store_keeps_the_ratio(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 32)
    it = iter(
        gr.make_data_loader(
            gr.open_source(path),
            batch_size=8,
            num_epochs=None,
            sampling=gr.PrioritizedReplay(
                min_size=16, samples_per_insert=1.0, tolerance=16, timeout=0.2
            ),
        )
    )
    for _ in range(4):  # ceiling 1 * (32 - 16) + 16 = 32 rows
        batch = next(it)
        assert isinstance(batch, gr.Sampled)
        it.update_priorities(batch.index, np.ones(8))
    with pytest.raises(gr.RateLimitTimeoutError, match="allow 32"):
        next(it)
    _store(path, 8, "more")
    check_rows(next(it).data)
    time.sleep(0.05)
    p = learners_lib.read_progress(os.path.join(path, "learners"), "process-0-of-1.json")
    assert p is not None and p.sampled == 40 and p.drawn == 40
    it.close()


def test_sharded_device_put_prefetch_counts_as_handed_out(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _store(path, 24)
    # ceiling 1 * 24 + 16 = 40 rows: 5 batches, wherever they are prefetched
    loader = _loader(path, samples_per_insert=1.0, tolerance=16, timeout=0.3)
    batches = gr.sharded_device_put(loader, prefetch=2)
    try:
        for _ in range(5):
            check_rows({k: np.asarray(v) for k, v in next(batches).items()})
        with pytest.raises(gr.RateLimitTimeoutError):
            next(batches)
    finally:
        batches.close()


def test_leaving_a_device_put_block_withdraws_the_learner(tmp_path: Path) -> None:
    # the README's online quick start: "leaving it: actors stop waiting for it"; the
    # wrapper's close() left the learner's progress file up until the wrapper was collected
    path = str(tmp_path / "s")
    _store(path, 24)
    learners = os.path.join(path, "learners")
    loader = _loader(path, samples_per_insert=1.0, tolerance=16, timeout=5)
    with gr.sharded_device_put(loader, prefetch=0) as batches:
        check_rows({k: np.asarray(v) for k, v in next(batches).items()})
        assert learners_lib.read_progress(learners, "process-0-of-1.json") is not None
    assert learners_lib.read_progress(learners, "process-0-of-1.json") is None
    assert batches.get_state()  # the wrapper, closed, still gives its state
