"""``gr.RateLimit`` on both sides: declared by writers before any learner exists, held from a
learner's loader build, refused where two sides contradict (docs/rate_limits.md)."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sampling.rate import publish as publish_lib
from grain_replay.sampling.rate.options import limit_of
from grain_replay.store import progress as learners_lib

HELPERS = Path(__file__).parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))
from parts_child import check_rows, make_rows  # noqa: E402
from rate_writer import run_writer  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")
PROGRESS = "process-0-of-1.json"


def _loader(path: str, batch_size: int = 8, cls: Any = gr.UniformReplay, **options: Any) -> Any:
    return gr.make_data_loader(
        gr.open_source(path), batch_size=batch_size, num_epochs=None, sampling=cls(**options)
    )


def _writer(path: str, writer_id: str = "w", **kwargs: Any) -> gr.ReplayWriter:
    return gr.ReplayWriter(path, "npy", capacity=100_000, writer_id=writer_id, **kwargs)


def _inserted(path: str) -> int:
    return learners_lib.InsertedCount(path).read()[0]


def _progress(path: str) -> learners_lib.Progress | None:
    return learners_lib.read_progress(os.path.join(path, "learners"), PROGRESS)


def _wait_for(what: Any, timeout: float = 60.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        assert time.monotonic() < end, f"not true after {timeout} s"
        time.sleep(0.02)


def _report(path: str, timeout: float = 120.0) -> dict[str, Any]:
    _wait_for(lambda: os.path.exists(path), timeout)
    with open(path) as f:
        out: dict[str, Any] = json.load(f)
    return out


# -- the value object ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        ({"min_size": -1, "samples_per_insert": 1.0}, "min_size must be >= 0"),
        ({"min_size": 2.5}, "min_size must be an int"),
        ({"min_size": True}, "min_size must be an int"),
        ({"samples_per_insert": 0}, "samples_per_insert must be a positive"),
        ({"samples_per_insert": float("inf")}, "samples_per_insert must be a positive"),
        ({"samples_per_insert": "2"}, "samples_per_insert must be a number"),
        ({"min_size": 4, "tolerance": 3}, "samples_per_insert is None"),
        ({"samples_per_insert": 1.0, "tolerance": -0.5}, "tolerance must be a finite"),
        ({"samples_per_insert": 1.0, "timeout": 0}, "timeout must be positive"),
        ({}, "got neither"),
        ({"timeout": 5.0}, "got neither"),
    ],
)
def test_rate_limit_refuses_bad_values(kwargs: dict[str, Any], phrase: str) -> None:
    with pytest.raises(gr.InvalidSamplingError, match=phrase) as info:
        gr.RateLimit(**kwargs)
    msg = str(info.value)
    assert msg.startswith("RateLimit: ") and "Fix:" in msg, msg
    assert isinstance(info.value, ValueError)


def test_rate_limit_normalizes_numbers_and_names_its_terms() -> None:
    limit = gr.RateLimit(min_size=np.int64(5), samples_per_insert=np.float32(2), tolerance=3)
    assert (limit.min_size, limit.samples_per_insert, limit.tolerance) == (5, 2.0, 3.0)
    assert type(limit.min_size) is int and type(limit.samples_per_insert) is float
    assert limit.terms() == "RateLimit(min_size=5, samples_per_insert=2.0, tolerance=3.0)"
    assert limit.agrees(gr.RateLimit(min_size=5, samples_per_insert=2, tolerance=3, timeout=9))
    assert not limit.agrees(gr.RateLimit(min_size=5, samples_per_insert=2))
    # before any learner: the given tolerance, else Acme's 10 % (at least one row's samples)
    assert limit.writer_tolerance() == 3.0
    assert gr.RateLimit(min_size=1000, samples_per_insert=8).writer_tolerance() == 800.0
    assert gr.RateLimit(samples_per_insert=8).writer_tolerance() == 8.0
    assert gr.RateLimit(min_size=10).writer_tolerance() is None


@pytest.mark.parametrize("cls", [gr.UniformReplay, gr.PrioritizedReplay])
def test_sampler_takes_a_rate_limit_or_the_flat_shorthand(cls: Any) -> None:
    limit = gr.RateLimit(min_size=16, samples_per_insert=2.0, tolerance=20, timeout=3)
    opts = cls(rate_limit=limit)
    assert (opts.min_size, opts.samples_per_insert, opts.tolerance, opts.timeout) == (
        16,
        2.0,
        20.0,
        3.0,
    )
    assert limit_of(opts) is limit
    flat = cls(min_size=16, samples_per_insert=2, tolerance=20, timeout=3)
    assert limit_of(flat) == limit
    assert limit_of(cls()) is None
    # a flat field that says the same is fine
    assert cls(rate_limit=limit, min_size=16).min_size == 16


@pytest.mark.parametrize("cls", [gr.UniformReplay, gr.PrioritizedReplay])
def test_sampler_refuses_a_rate_limit_and_flat_fields_that_disagree(cls: Any) -> None:
    limit = gr.RateLimit(min_size=16, samples_per_insert=2.0)
    with pytest.raises(gr.InvalidSamplingError) as info:
        cls(rate_limit=limit, samples_per_insert=4.0)
    msg = str(info.value)
    for part in (
        cls.__name__,
        "samples_per_insert=4.0 but rate_limit.samples_per_insert=2.0",
        "Fix: pass rate_limit=",
    ):
        assert part in msg, msg
    timed = gr.RateLimit(min_size=16, samples_per_insert=2.0, timeout=2)
    with pytest.raises(gr.InvalidSamplingError, match=r"timeout=1\.0 but rate_limit\.timeout=2\.0"):
        cls(rate_limit=timed, timeout=1)
    # the timeout is this side's own: a flat one fills a limit's None
    opts = cls(rate_limit=limit, timeout=1)
    assert opts.timeout == 1.0 and limit_of(opts) == gr.RateLimit(16, 2.0, timeout=1)
    with pytest.raises(gr.ArgumentTypeError, match=r"rate_limit must be a gr.RateLimit.*Fix"):
        cls(rate_limit={"samples_per_insert": 2.0})


def test_writer_refuses_a_bad_rate_limit(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    with pytest.raises(gr.InvalidArgumentError, match=r"rate_limit must be a gr.RateLimit.*Fix"):
        _writer(path, rate_limit=2.0)
    limit = gr.RateLimit(samples_per_insert=2.0, timeout=5)
    with pytest.raises(gr.InvalidArgumentError, match=r"rate_limit_timeout=1.0 but.*Fix"):
        _writer(path, rate_limit=limit, rate_limit_timeout=1.0)
    assert gr.RateLimit.of_store(path) is None  # nothing declared by refused writers


# -- writers before any learner ----------------------------------------------------------------


def test_one_writer_with_no_learner_holds_at_the_bound(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    limit = gr.RateLimit(min_size=32, samples_per_insert=2.0, tolerance=16)
    w = _writer(path, rate_limit=limit, rate_limit_timeout=0.3)
    assert gr.RateLimit.of_store(path) == limit  # declared before the first row
    # bound: min_size + tolerance / r = 32 + 8 = 40 rows
    w.append(make_rows("w", 0, 30))
    assert w.flush() == 30
    w.append(make_rows("w", 30, 10))
    assert w.flush() == 40  # 2 * (40 - 32) - 0 = 16 <= 16
    w.append(make_rows("w", 40, 1))
    with pytest.raises(gr.RateLimitTimeoutError) as info:
        w.flush()
    msg = str(info.value)
    assert "no learner yet" in msg and "40 rows inserted and 1 more pending" in msg, msg
    assert w.committed == 40 and _inserted(path) == 40
    w.close()  # close commits without waiting, as always
    # a flush that crosses min_size goes whole: the bound's "one flush's rows"
    crossing = str(tmp_path / "crossing")
    c = _writer(crossing, rate_limit=limit, rate_limit_timeout=0.3)
    c.append(make_rows("w", 0, 44))
    assert c.flush() == 44  # fewer than min_size live before it: the learner could not draw
    c.append(make_rows("w", 44, 1))
    with pytest.raises(gr.RateLimitTimeoutError):
        c.flush()
    c.close()
    # a writer given no limit follows the store's all the same
    other = _writer(path, "other", rate_limit_timeout=0.2)
    other.append(make_rows("other", 0, 1))
    with pytest.raises(gr.RateLimitTimeoutError):
        other.flush()
    other.close()


def test_writer_processes_started_before_any_learner_hold_then_follow_it(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "s")
    r, m, e, block = 2.0, 32, 16.0, 4
    bound = m + e / r  # 40 rows before any learner
    kwargs = {"min_size": m, "samples_per_insert": r, "tolerance": e}
    reports = [str(tmp_path / f"r{i}.json") for i in range(2)]
    procs = [
        SPAWN.Process(
            target=run_writer,
            args=(path, f"a{i}", block, 50, 0.0, reports[i], 100_000, 1.0, kwargs),
        )
        for i in range(2)
    ]
    for p in procs:
        p.start()
    try:
        outs = [_report(rep) for rep in reports]  # each flush waits 1 s, then raises
        for out in outs:
            assert out["error"][0] == "RateLimitTimeoutError", out
            assert "no learner yet" in out["error"][1]
            assert out["pending"] == block
        # committed before any learner: the bound, plus a flush's rows of a writer that
        # flushed at the same instant as the other (each checks before it commits)
        committed = sum(out["committed"] for out in outs)
        assert bound <= committed <= bound + block, committed
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert _inserted(path) == committed + 2 * block  # close() committed the pending rows
    committed = _inserted(path)
    # a learner given no limit takes the store's; its loader holds the writers from now on
    loader = _loader(path, timeout=60)
    p0 = _progress(path)
    assert p0 is not None and p0.sampled == 0 and p0.samples_per_insert == r
    report = str(tmp_path / "late.json")
    proc = SPAWN.Process(
        target=run_writer,
        args=(path, "late", block, 40, 0.0, report, 100_000, 60.0, kwargs),
    )
    proc.start()
    try:
        it = iter(loader)
        total = committed + 40 * block
        batches = math.ceil((r * (total - m) - e) / 8)  # enough for every row to go in
        for k in range(batches):
            check_rows(next(it))
            handed = (k + 1) * 8
            assert handed <= r * (_inserted(path) - m) + e
        out = _report(report)
        assert out["error"] is None and out["committed"] == 40 * block
        assert _inserted(path) == total
        it.close()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    # closed over a store that declares a limit: the file stays, marked closed, and the
    # writers hold at what the learner handed out (as a Reverb table keeps its counts)
    p1 = _progress(path)
    assert p1 is not None and p1.closed and p1.sampled == batches * 8
    w = _writer(path, "after", rate_limit_timeout=0.2)
    room = int(m + (p1.sampled + e) / r) - _inserted(path)
    if room > 0:
        w.append(make_rows("after", 0, room))
        w.flush()
    w.append(make_rows("after", max(room, 0), 1))
    with pytest.raises(gr.RateLimitTimeoutError, match=r"last learner process-0-of-1\.json gone"):
        w.flush()
    w.close()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_closed_learner_leaves_its_last_count_not_the_heartbeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The heartbeat thread publishes hand-outs coalesced, later; here it never runs (as one
    # descheduled on a loaded machine). close() must still leave the rows handed out: a
    # file closed at an older count held examples/ray_actors.py's actors short of their
    # last rows, with no learner left to release them.
    monkeypatch.setattr(publish_lib, "_heartbeat", lambda ref, dirty, stop, *rest: stop.wait())
    path = str(tmp_path / "s")
    limit = gr.RateLimit(min_size=16, samples_per_insert=1.0, tolerance=16)
    seed = _writer(path, "seed", rate_limit=limit)
    seed.append(make_rows("seed", 0, 32))
    seed.flush()
    seed.close()
    it = iter(_loader(path))  # the store's limit; ceiling 1 * (32 - 16) + 16 = 32 rows
    for _ in range(3):
        check_rows(next(it))
    early = _progress(path)
    assert early is not None and early.sampled < 24  # only the first draw was published
    it.close()
    p = _progress(path)
    assert p is not None and p.closed and p.sampled == 24
    # the writers hold at those 24 rows: room for 16 + (24 + 16) / 1 - 32 = 24 more
    w = _writer(path, "after", rate_limit_timeout=0.2)
    w.append(make_rows("after", 0, 24))
    w.flush()
    w.append(make_rows("after", 24, 1))
    with pytest.raises(gr.RateLimitTimeoutError, match="handed out 24 rows"):
        w.flush()
    w.close()


# -- a learner holds from its loader build -------------------------------------------------------


@pytest.mark.parametrize("declared", [False, True])
def test_learner_limit_holds_writers_from_loader_build(tmp_path: Path, declared: bool) -> None:
    path = str(tmp_path / "s")
    limit = gr.RateLimit(min_size=16, samples_per_insert=1.0, tolerance=16)
    seed = _writer(path, "seed", rate_limit=limit if declared else None)
    seed.append(make_rows("seed", 0, 16))
    seed.flush()
    seed.close()
    w = _writer(path, rate_limit_timeout=0.3)
    w.append(make_rows("w", 0, 24))
    if declared:  # 1 * (16 + 24 - 16) - 0 > 16: held with no learner
        with pytest.raises(gr.RateLimitTimeoutError):
            w.flush()
        assert w.committed == 0
        w.close()  # commits without waiting
        w = _writer(path, "w2", rate_limit_timeout=0.3)
    else:  # no learner and no declared limit: nothing holds the writer
        assert w.flush() == 24
    loader = _loader(path, rate_limit=limit)  # no batch drawn
    built = _progress(path)
    assert built is not None and built.sampled == 0 and built.drawn == 0
    assert built.given_tolerance == 16.0
    before = _inserted(path)
    w.append(make_rows(w.writer_id or "", 0, 25))
    with pytest.raises(gr.RateLimitTimeoutError, match=r"learner process-0-of-1\.json"):
        w.flush()  # ahead of a learner that has handed out nothing
    assert _inserted(path) == before
    # the first iterator takes the loader's file over: the same token, no gap
    it = iter(loader)
    for _ in range(4):
        check_rows(next(it))
    after = _wait_for(lambda: (p := _progress(path)) is not None and p.sampled == 32 and p)
    assert after.token == built.token and not after.closed
    it.close()
    del loader, it
    if not declared:
        assert not os.listdir(os.path.join(path, "learners"))  # withdrawn: the writer goes on
        assert w.flush() == 24 + 25
    else:  # the store declares a limit: the closed learner's count (32) holds the writer:
        # 1 * (40 + 25 - 16) - 32 = 17 > 16
        with pytest.raises(gr.RateLimitTimeoutError, match="last learner"):
            w.flush()
    w.close()


def test_loader_dropped_before_iterating_withdraws_its_file(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    seed = _writer(path, "seed")
    seed.append(make_rows("seed", 0, 8))
    seed.close()
    loader = _loader(path, samples_per_insert=1.0, tolerance=8)
    assert _progress(path) is not None
    del loader
    assert not os.listdir(os.path.join(path, "learners"))


def test_replay_dataset_holds_writers_from_build(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    seed = _writer(path, "seed")
    seed.append(make_rows("seed", 0, 8))
    seed.close()
    ds = gr.replay_dataset(
        gr.open_source(path),
        batch_size=4,
        sampling=gr.UniformReplay(rate_limit=gr.RateLimit(samples_per_insert=1.0, tolerance=8)),
    )
    built = _progress(path)
    assert built is not None and built.sampled == 0
    it = iter(ds)
    next(it)
    p = _wait_for(lambda: (q := _progress(path)) is not None and q.sampled == 4 and q)
    assert p.token == built.token


# -- contradictions ------------------------------------------------------------------------------


def test_second_writer_declaring_another_limit_is_refused_naming_both(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    first = gr.RateLimit(min_size=100, samples_per_insert=4.0)
    a = _writer(path, "a", rate_limit=first)
    with pytest.raises(gr.InvalidSamplingError) as info:
        _writer(path, "b", rate_limit=gr.RateLimit(min_size=100, samples_per_insert=8.0))
    msg = str(info.value)
    for part in (
        "writer 'b'",
        "rate_limit=RateLimit(min_size=100, samples_per_insert=8.0, tolerance=None)",
        "declares, RateLimit(min_size=100, samples_per_insert=4.0, tolerance=None)",
        "limit.json",
        "Fix: pass rate_limit=RateLimit(min_size=100, samples_per_insert=4.0",
    ):
        assert part in msg, msg
    # refused before its first row: its id is free again, and the same limit is accepted
    b = _writer(path, "b", rate_limit=gr.RateLimit(min_size=100, samples_per_insert=4, timeout=9))
    b.close()
    a.close()
    assert gr.RateLimit.of_store(path) == first


def test_learner_contradicting_the_store_is_refused_naming_both(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    w = _writer(path, rate_limit=gr.RateLimit(min_size=8, samples_per_insert=2.0, tolerance=16))
    w.append(make_rows("w", 0, 8))
    w.flush()
    for cls in (gr.UniformReplay, gr.PrioritizedReplay):
        with pytest.raises(gr.InvalidSamplingError) as info:
            _loader(path, cls=cls, min_size=8, samples_per_insert=4.0, tolerance=16)
        msg = str(info.value)
        for part in (
            f"{cls.__name__} over {path}",
            "RateLimit(min_size=8, samples_per_insert=4.0, tolerance=16.0) contradicts",
            "declares, RateLimit(min_size=8, samples_per_insert=2.0, tolerance=16.0)",
            "Fix: sample with rate_limit=RateLimit(min_size=8, samples_per_insert=2.0",
        ):
            assert part in msg, msg
    assert not os.path.exists(os.path.join(path, "learners", PROGRESS))
    w.close()


def test_writer_contradicting_a_live_learner_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    seed = _writer(path, "seed")
    seed.append(make_rows("seed", 0, 8))
    seed.close()
    loader = _loader(path, samples_per_insert=2.0, tolerance=16)
    with pytest.raises(gr.InvalidSamplingError) as info:
        _writer(path, rate_limit=gr.RateLimit(samples_per_insert=3.0, tolerance=16))
    msg = str(info.value)
    assert "contradicts the limit of the live learner" in msg
    assert "RateLimit(min_size=0, samples_per_insert=2.0, tolerance=16.0)" in msg
    assert gr.RateLimit.of_store(path) is None
    _writer(path, rate_limit=gr.RateLimit(samples_per_insert=2.0, tolerance=16)).close()
    del loader


def test_learner_without_a_limit_takes_the_stores(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    w = _writer(path, rate_limit=gr.RateLimit(min_size=8, samples_per_insert=1.0, tolerance=8))
    w.append(make_rows("w", 0, 16))
    w.flush()
    w.close()
    it = iter(_loader(path, timeout=0.2))  # ceiling 1 * (16 - 8) + 8 = 16 rows: 2 batches
    next(it)
    next(it)
    with pytest.raises(gr.RateLimitTimeoutError, match="allow 16"):
        next(it)
    it.close()


def test_damaged_declaration_names_the_file_and_the_fix(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    _writer(path, rate_limit=gr.RateLimit(samples_per_insert=1.0)).close()
    declared = os.path.join(path, "learners", "limit.json")
    with open(declared, "w") as f:
        f.write("{not json")
    with pytest.raises(gr.InvalidStoreError, match=r"limit\.json.*Fix: remove the file"):
        gr.RateLimit.of_store(path)
    assert isinstance(gr.RateLimit.of_store(str(tmp_path / "none")), type(None))


def test_plain_store_declares_beside_it(tmp_path: Path) -> None:
    path = str(tmp_path / "plain")
    limit = gr.RateLimit(samples_per_insert=1.0, tolerance=4)
    w = gr.ReplayWriter(path, "npy", rate_limit=limit, rate_limit_timeout=0.2)
    assert os.path.isfile(path + ".learners/limit.json")
    w.append(make_rows("p", 0, 4))
    assert w.flush() == 4  # 1 * 4 - 0 <= 4
    w.append(make_rows("p", 4, 1))
    with pytest.raises(gr.RateLimitTimeoutError):
        w.flush()
    w.close()
    assert gr.RateLimit.of_store(path) == limit
