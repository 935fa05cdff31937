"""Hostile and malformed stores: every one gets a named GrainReplayError, fast, small, no crash.

The corpus (``tests/helpers/hostile.py``) is written once per module run: truncated
HDF5 / ``.npy`` / Zarr files at many offsets, wrong magic bytes, pickle payloads,
declared shapes of 2**60, metadata that lies, FIFOs, and references out of the
store (HDF5 external links, virtual datasets, external raw storage, symlinks).
Each case is opened and read in a child process under a 2 GiB address-space
limit, so a crash, a hang or a giant allocation costs one case, not the suite.

Errors may surface at construction or at the first read; either way they must be
a ``gr.GrainReplayError`` whose message names the store (and the leaf, when one
is at fault). References out of the store must be refused unless the caller opts
in with ``allow_external=True``, and then read from where they point.

``python tests/helpers/hostile.py --table`` prints every case with its answer.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
from typing import Any

import hostile
import numpy as np
import pytest

import grain_replay as gr

pytestmark = pytest.mark.timeout(240)

# References out of the store: refused without allow_external=True, read with it.
EXTERNAL = frozenset(
    {
        "hdf5_external_link",
        "hdf5_external_link_foreign",
        "hdf5_virtual_dataset",
        "hdf5_external_storage",
        "npy_symlink_leaf_outside",
        "npy_symlink_dir_outside",
        "npy_symlink_meta_outside",
        "npy_symlink_foreign_outside",
        "zarr_symlink_chunk_outside",
        "zarr_symlink_array_outside",
    }
)

# -- the corpus, probed once per module -----------------------------------------------------


def _cases(expect: str | tuple[str, ...]) -> list[str]:
    return [
        n
        for n in hostile.CASE_NAMES
        if _expect_of(n) in (expect if isinstance(expect, tuple) else (expect,))
    ]


def _expect_of(name: str) -> str:
    if name.startswith("control_"):
        return "accept"
    if name in EXTERNAL:
        return "external"
    if name in ("hdf5_foreign_shape_2p60", "zarr_foreign_shape_2p60", "zarr_shape_lie_2p60"):
        return "bounded"
    if name.endswith("_namedtuple_imports_module"):
        return "bounded"
    return "refuse"


def _params(names: list[str]) -> list[Any]:
    return [pytest.param(n, id=n) for n in names]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, hostile.Case]:
    cases = hostile.build_corpus(str(tmp_path_factory.mktemp("hostile")))
    for name, case in cases.items():
        assert case.expect == _expect_of(name), (name, case.expect)
    return cases


SELFTEST = ("selftest_crashes", "selftest_after_crash", "selftest_hangs", "selftest_after_hang")


def _selftest_cases(ok: hostile.Case) -> list[hostile.Case]:
    """Cases that check the harness itself: a segfault and a hang cost one case each."""
    return [
        dataclasses.replace(ok, name=SELFTEST[0], opener="_selftest_segfault"),
        dataclasses.replace(ok, name=SELFTEST[1]),
        dataclasses.replace(ok, name=SELFTEST[2], opener="_selftest_hang"),
        dataclasses.replace(ok, name=SELFTEST[3]),
    ]


@pytest.fixture(scope="module")
def answers(corpus: dict[str, hostile.Case]) -> dict[str, dict[str, Any]]:
    # Cases that hang (FIFOs) and the harness's own crash/hang cases go first, so that
    # the round-robin deal spreads the hangs over the children.
    slow = [c for n, c in corpus.items() if "fifo" in n]
    rest = [c for n, c in corpus.items() if "fifo" not in n]
    selftest = _selftest_cases(corpus["control_npy"])
    order = [*slow, selftest[0], selftest[2], *rest, selftest[1], selftest[3]]
    t0 = time.perf_counter()
    # One child per core: case timings stay honest on a 2-core CI machine.
    results = hostile.run_corpus(order, shards=2, hang_after_s=3.0)
    assert set(results) == set(corpus) | set(SELFTEST)
    print(f"\n{len(results)} hostile cases probed in {time.perf_counter() - t0:.1f} s")
    return results


def _describe(case: hostile.Case, r: dict[str, Any]) -> str:
    if r["outcome"] == "raised":
        return f"{case.name} ({case.what}): {r['error_type']} at {r['stage']}: {r['message']}"
    return f"{case.name} ({case.what}): {r['outcome']} {r.get('message', '')}"


def _assert_named_error(case: hostile.Case, r: dict[str, Any], *extra: str) -> None:
    assert r["outcome"] == "raised", _describe(case, r)
    assert r["is_grain_replay_error"], _describe(case, r)
    msg = r["message"]
    assert case.store in msg, f"the message does not name the store: {_describe(case, r)}"
    if case.leaf is not None:
        assert case.leaf in msg, f"the message does not name leaf {case.leaf!r}: {msg}"
    for word in extra:
        assert word in msg, f"the message does not say {word!r}: {msg}"


# -- the tests ---------------------------------------------------------------------------------


def test_corpus_names_match_builder(corpus: dict[str, hostile.Case]) -> None:
    assert tuple(corpus) == hostile.CASE_NAMES
    assert len(corpus) >= 140


@pytest.mark.parametrize("name", _params(_cases("refuse")))
def test_malformed_store_raises_named_grain_replay_error_when_opened_or_read(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    _assert_named_error(corpus[name], answers[name])


@pytest.mark.parametrize("name", _params(list(hostile.CASE_NAMES)))
def test_hostile_store_answers_within_a_second_without_crash_or_big_allocation(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    r = answers[name]
    assert r["outcome"] in ("accepted", "raised"), _describe(corpus[name], r)
    assert r["elapsed_s"] < 1.0, _describe(corpus[name], r) + f" took {r['elapsed_s']:.2f} s"
    assert r.get("error_type") != "MemoryError", _describe(corpus[name], r)
    grew = r["peak_rss_growth_mb"]
    assert grew < hostile.RSS_BOUND_MB, f"{name}: peak RSS grew {grew:.0f} MiB"


@pytest.mark.parametrize("name", _params(_cases("external")))
def test_reference_out_of_store_refused_without_allow_external(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    _assert_named_error(corpus[name], answers[name], "allow_external=True")


@pytest.mark.parametrize("name", _params(_cases("external")))
def test_reference_out_of_store_reads_target_with_allow_external(
    name: str, corpus: dict[str, hostile.Case]
) -> None:
    case = corpus[name]
    src = gr.open_source(case.store, allow_external=True)
    # No leaf at fault: the metadata file is the reference, and obs is the store's own.
    key = case.leaf or "obs"
    assert key in src.spec
    got = src.read_leaf(key, np.arange(hostile.N))
    want = hostile.outside_obs() if case.leaf else hostile.base_tree()["obs"]
    np.testing.assert_array_equal(got, want)
    src.close()


@pytest.mark.parametrize("name", _params(_cases("bounded")))
def test_declared_huge_store_answers_within_bounds_when_sparse(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    r = answers[name]
    assert r["outcome"] == "accepted" or r["is_grain_replay_error"], _describe(corpus[name], r)
    if r["outcome"] == "accepted" and "obs_head" in r:
        assert r["obs_head"] == [0.0] * 4 + [1.0] * 4, r["obs_head"]


@pytest.mark.parametrize("name", _params(_cases("accept")))
def test_intact_store_reads_back_exactly_when_control(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    r = answers[name]
    assert r["outcome"] == "accepted", _describe(corpus[name], r)
    assert r["num_records"] == hostile.N
    assert r["obs_head"] == [0.0] * 4 + [1.0] * 4, r["obs_head"]


def test_pickle_payload_never_loaded_when_opening_any_store(
    corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    armed = [c for c in corpus.values() if c.marker and "pickle" in c.what]
    assert len(armed) >= 5
    for case in armed:
        assert not answers[case.name]["marker_exists"], f"{case.name} unpickled its payload"
        assert not os.path.exists(case.marker), case.name


@pytest.mark.parametrize(
    "name",
    _params([n for n in hostile.CASE_NAMES if n.endswith("_namedtuple_imports_module")]),
)
def test_metadata_never_imports_named_module_when_opening_store(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    case = corpus[name]
    assert case.marker is not None and case.pythonpath is not None
    assert os.path.exists(os.path.join(case.pythonpath, f"gr_planted_{name.split('_')[0]}.py"))
    assert not answers[name]["marker_exists"], f"{name}: opening the store imported the module"


def test_pickle_payload_creates_marker_when_unpickled(tmp_path: Any) -> None:
    """The trap works: were any source to unpickle the corpus payloads, the marker would appear."""
    marker = str(tmp_path / "marker")
    pickle.loads(hostile.pickle_payload(marker))
    assert os.path.exists(marker)


def test_probe_reports_giant_allocation_when_address_space_is_limited(tmp_path: Any) -> None:
    """The sandbox works: a 4 GiB allocation fails in the probe child instead of swapping."""
    code = (
        "import resource, numpy as np, hostile\n"
        "resource.setrlimit(resource.RLIMIT_AS, (hostile.PROBE_ADDRESS_SPACE,) * 2)\n"
        "try:\n    np.ones(2**32, np.uint8)\nexcept MemoryError:\n    print('refused')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(hostile.__file__))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.strip() == "refused", out.stderr


def test_probe_reports_crash_and_hang_of_one_case_and_runs_the_rest(
    answers: dict[str, dict[str, Any]],
) -> None:
    """The harness works: a segfault or a hang costs one case, and the next ones still run."""
    crashed, after_crash, hung, after_hang = (answers[n] for n in SELFTEST)
    assert crashed["outcome"] == "crash" and crashed["returncode"] == -signal.SIGSEGV, crashed
    assert hung["outcome"] == "hang", hung
    assert after_crash["outcome"] == after_hang["outcome"] == "accepted"


def _write_for_truncation(tmp_path: Any, kind: str) -> tuple[str, str]:
    """A 4096-record store whose ``obs`` is memory-mapped; returns (store, file to truncate)."""
    if kind == "npy":
        store = str(tmp_path / "store")
        gr.write(store, hostile.base_tree(4096), format="npy")
        return store, os.path.join(store, "obs.npy")
    store = str(tmp_path / "store.h5")
    if kind == "hdf5_contiguous":
        gr.write(store, hostile.base_tree(4096), format="hdf5")
    else:  # chunked, written by a ReplayWriter: chunks mapped back to back
        with gr.ReplayWriter(store, chunk_rows=1024) as w:
            w.append(hostile.base_tree(4096))
    return store, store


@pytest.mark.parametrize("kind", ["npy", "hdf5_contiguous", "hdf5_chunked"])
def test_leaf_truncated_under_live_map_raises_instead_of_sigbus(tmp_path: Any, kind: str) -> None:
    """A mapped file truncated in place: the next batch raises a named error, not SIGBUS.

    Readers fstat each mapped file before a batch. (A truncation racing with the
    read right after that check can still SIGBUS; SECURITY.md says so.)
    """
    store, victim = _write_for_truncation(tmp_path, kind)
    code = (
        "import os, sys, numpy as np, grain_replay as gr\n"
        f"src = gr.open_source({store!r})\n"
        "assert type(src._get_handle().readers['obs']).__name__ == 'ArrayReader'\n"
        "src.read_batch([0, 4095])\n"
        f"os.truncate({victim!r}, 4096)\n"
        "for read in (lambda: src.read_batch([4095]), lambda: src[4095],\n"
        "             lambda: src.read_leaf('obs', [4095])):\n"
        "    try:\n        read()\n    except gr.InvalidStoreError as e:\n"
        "        print('named error:', e)\n    else:\n        sys.exit(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != -signal.SIGBUS, "the reader died of SIGBUS"
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout
    for line in lines:
        assert victim in line and "'obs'" in line and "truncated" in line, line
