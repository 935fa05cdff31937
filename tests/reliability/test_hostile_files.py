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

Known bugs are ``xfail(strict=True)`` with a ``BUG:``/``MISSING:`` reason naming
the code to fix; fixing one turns its xfail into an XPASS failure, so the mark
must go with the fix. ``python tests/helpers/hostile.py --table`` prints every
case with its answer.
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

# -- known bugs ----------------------------------------------------------------------------

META_ESCAPES = (
    "BUG: layout.StoreMetadata.from_json (grain_replay/layout.py, the except clause after "
    "'checksums = raw.get(...)') catches only ValueError/KeyError/TypeError/AttributeError, "
    "so {exc} escapes raw, without the file name. Fix: also catch RecursionError and "
    "OverflowError there, and parse num_records/version/shape with a helper that accepts "
    "only JSON ints (isinstance(x, int) and not bool) so Infinity/1e400/true are refused."
)
BUGS: dict[str, str] = {
    "meta_deep_nesting": META_ESCAPES.format(exc="RecursionError from json.loads on deep nesting"),
    "meta_infinity": META_ESCAPES.format(exc="OverflowError from int(float('inf'))"),
    "meta_bad_dtype_string": (
        "BUG: layout.StoreMetadata.from_json reports a bad leaf dtype ('not-a-dtype') as "
        "'metadata is malformed (data type ... not understood)' without naming the leaf. Fix: "
        'parse each leaf inside try/except and re-raise with f"leaf {k!r}: {e}".'
    ),
    "meta_treedef_unknown_type": (
        "BUG: tree.leaf_keys raises InvalidStoreError(\"Unknown tree node type 'bogus' in "
        'stored tree structure.") and layout.StoreMetadata.from_json re-raises it unchanged '
        "('except InvalidStoreError: raise'), so the message names no file. Fix: re-raise "
        "with the where= prefix (f'{where}: {e}') or pass where into leaf_keys."
    ),
    "hdf5_meta_dtype_lie": (
        "BUG: sources/hdf5.py HDF5DataSource._check_dataset compares only shapes: metadata "
        "saying <f8 over a float32 dataset is accepted, spec says float64 and reads return "
        "float32. Fix: also require dset.dtype == meta.leaves[key].dtype (InvalidStoreError "
        "naming file, leaf, both dtypes)."
    ),
    "zarr_meta_dtype_lie": (
        "BUG: sources/zarr.py ZarrDataSource._layout_of compares only shapes with the metadata: "
        "metadata <f8 over a float32 array is accepted and the mapped reader reinterprets the "
        "float32 chunk bytes as float64 (silent garbage: 0.0078125, 2.0000005, 32.000008...). "
        "Fix: require np.dtype(arr.dtype) == meta.leaves[key].dtype in _layout_of."
    ),
    "zarr_dtype_lie": (
        "BUG: sources/zarr.py ZarrDataSource._layout_of does not compare the array's zarr.json "
        "data_type (float64) with the grain_replay metadata (<f4); the store opens as if "
        "consistent. Fix: the same dtype check as for zarr_meta_dtype_lie."
    ),
    "hdf5_gzip_chunk_garbage": (
        "BUG: sources/decode.py hdf5_direct_block_reader's decode() lets zlib.error ('Error -3 "
        "while decompressing data') escape raw, naming neither file nor leaf (and the h5py "
        "fallback, hdf5.py _block_reader, lets OSError 'filter returned failure' escape). Fix: "
        "wrap read_blocks of both in try/except (zlib.error, OSError, ValueError) and raise "
        "InvalidStoreError(f'{path}: leaf {key!r} chunk {c} (rows [a, b)) cannot be decoded "
        "({e}); the file is corrupt') from e."
    ),
    "hdf5_gzip_chunk_bomb": (
        "BUG: sources/decode.py hdf5_direct_block_reader's decode() calls zlib.decompress(raw) "
        "without a bound: a 100 KiB chunk inflating to 96 MiB of zeros costs ~2x that in RSS "
        "(per decode-pool thread, up to 8 at once) and ~1-2 s, and the extra bytes are "
        "silently ignored (np.frombuffer(count=chunk_items)), so the leaf reads as zeros. Fix: "
        "d = zlib.decompressobj(); data = d.decompress(raw, chunk_bytes + 1); refuse with "
        "InvalidStoreError (file, leaf, chunk) unless len(data) == chunk_bytes and d.eof and "
        "not d.unconsumed_tail."
    ),
    "fifo": (
        "BUG: a FIFO in place of a file makes open() block forever (a hang, not an error): "
        "{where}. Fix: before opening, require stat.S_ISREG(os.stat(path).st_mode) (after "
        "following symlinks) and raise InvalidStoreError naming the path 'is not a regular "
        "file'; in _find_npy_files skip or refuse non-regular *.npy entries."
    ),
    "npy_short_data": (
        "BUG: sources/npy.py checks only the .npy header, never that the file holds "
        "shape*itemsize bytes after it; _NpyHandle's np.load(mmap_mode='r') then raises a raw "
        "ValueError ('mmap length is greater than file size' / 'array is too big') at the "
        "first read, naming neither file nor leaf. Fix: in read_npy_header (or _inspect) "
        "compare os.fstat(f.fileno()).st_size with offset + prod(shape)*itemsize (with "
        "overflow-safe Python ints) and raise InvalidStoreError naming file and leaf."
    ),
    "npy_negative_shape": (
        "BUG: sources/npy.py read_npy_header returns a negative shape (-5, 4) from the header "
        "(numpy only checks the dims are ints); the source is built with len() = -5 and fails "
        "with 'ValueError: __len__() should return >= 0'. Fix: refuse any dim < 0 in "
        "read_npy_header with InvalidStoreError."
    ),
    "npy_deep_unary": (
        "BUG: sources/npy.py read_npy_header catches (ValueError, OSError, SyntaxError) but "
        "ast.literal_eval on a header like (-----...1,) raises RecursionError (5000 '-') or "
        "MemoryError (9000 '-'). Fix: also catch RecursionError and MemoryError there."
    ),
    "zarr_short_chunk": (
        "BUG: sources/zarr.py _raw_chunk_files accepts any existing chunk file; stitch() "
        "notices a short one and falls back to chunked.mapped_reader's np.memmap, which raises "
        "a raw ValueError ('mmap length is greater than file size'). Fix: in _raw_chunk_files "
        "require os.stat(f).st_size == chunk_rows * row_bytes (the Zarr bytes codec's exact "
        "chunk size) and raise InvalidStoreError naming the chunk file and leaf otherwise."
    ),
    "zarr_padding_truncated": (
        "BUG: a raw chunk file cut short inside its padding (rows >= N intact) is accepted by "
        "the mapped fast path, though zarr itself refuses to decode it; the fast path and zarr "
        "disagree on what is a valid store. Fix: the exact-size check of zarr_short_chunk."
    ),
    "zarr_codec_error": (
        "BUG: sources/zarr.py _block_reader lets codec errors escape raw (numcodecs "
        "RuntimeError 'Zstd decompression error', ValueError 'cannot reshape array of size "
        "262144 into shape (64,4)'), naming neither store nor leaf. Fix: wrap sync(fetch(...)) "
        "in try/except Exception (not MemoryError) and raise InvalidStoreError(f'{path}: leaf "
        "{key!r} chunks {ids} cannot be decoded ({type(e).__name__}: {e})') from e."
    ),
    "zarr_array_json": (
        "BUG: sources/zarr.py ZarrDataSource._layout_of wraps group[loc] (and _lookup of "
        "_fetch_arrays' results) in 'except KeyError' only; a truncated or binary "
        "<array>/zarr.json raises json.JSONDecodeError raw (no store, no leaf). Fix: catch "
        "(ValueError, TypeError, OSError) around group[loc] / _fetch_arrays and "
        "group.members() and raise InvalidStoreError naming the array's zarr.json and leaf."
    ),
    "zarr_giant_chunk": (
        "BUG: sources/zarr.py accepts an array whose chunk_shape is [2**60, 4]; the first read "
        "asks numpy for a 2**64-byte block and fails with a raw ValueError ('array is too "
        "big'). Fix: in _layout_of refuse arrays whose decoded chunk (prod(chunks) * itemsize) "
        "exceeds a bound (e.g. max(cache_bytes, 2 GiB)) with InvalidStoreError naming the leaf."
    ),
    "zarr_chunks_lie_bigger": (
        "BUG: obs/zarr.json declares 262144-row chunks over 65536-row chunk files; the mapped "
        "fast path maps the first rows and accepts it (zarr itself would refuse the size). "
        "Fix: the exact-size check of zarr_short_chunk."
    ),
}

_FIFO_WHERE = {
    "hdf5_fifo": "sources/hdf5.py HDF5DataSource._inspect, open(self._path).read(8)",
    "npy_fifo_leaf": "sources/npy.py read_npy_header, open(path, 'rb') of a *.npy FIFO",
    "zarr_fifo_chunk": "zarr's LocalStore reading obs/c/0/0 from sources/zarr.py _block_reader",
    "zarr_fifo_root_json": "zarr.open_group reading zarr.json in sources/zarr.py _open_group",
}


# Cases whose bugs were fixed since this corpus was written (their xfails passed).
_FIXED = frozenset(
    {
        "hdf5_gzip_chunk_bomb",
        "hdf5_external_link",
        "hdf5_external_link_foreign",
        "hdf5_virtual_dataset",
        "hdf5_external_storage",
        "hdf5_fifo",
        "hdf5_meta_dtype_lie",
        "npy_symlink_leaf_outside",
        "npy_symlink_dir_outside",
        "npy_symlink_meta_outside",
        "npy_symlink_foreign_outside",
        "hdf5_gzip_chunk_garbage",
        "hdf5_meta_bad_dtype_string",
        "hdf5_meta_deep_nesting",
        "hdf5_meta_infinity",
        "hdf5_meta_namedtuple_imports_module",
        "hdf5_meta_treedef_unknown_type",
        "npy_data_truncated_00",
        "npy_data_truncated_01",
        "npy_data_truncated_02",
        "npy_data_truncated_03",
        "npy_fifo_leaf",
        "npy_foreign_data_truncated",
        "npy_header_deep_unary",
        "npy_header_negative_shape_single",
        "npy_header_shape_2p60_meta",
        "npy_header_shape_2p60_single",
        "npy_meta_bad_dtype_string",
        "npy_meta_deep_nesting",
        "npy_meta_infinity",
        "npy_meta_namedtuple_imports_module",
        "npy_meta_treedef_unknown_type",
        "npy_single_data_truncated",
        "zarr_chunks_lie_smaller",
        "zarr_meta_bad_dtype_string",
        "zarr_meta_deep_nesting",
        "zarr_meta_infinity",
        "zarr_meta_namedtuple_imports_module",
        "zarr_meta_treedef_unknown_type",
        "zarr_zstd_chunk_garbage",
        "zarr_zstd_chunk_truncated_00",
        "zarr_zstd_chunk_truncated_01",
        "zarr_zstd_chunk_truncated_02",
        "zarr_array_json_garbage",
        "zarr_array_json_truncated_00",
        "zarr_array_json_truncated_01",
        "zarr_array_json_truncated_02",
        "zarr_chunk_truncated_00",
        "zarr_chunk_truncated_01",
        "zarr_chunk_truncated_02",
        "zarr_chunk_truncated_03",
        "zarr_chunk_truncated_04",
        "zarr_chunks_lie_bigger",
        "zarr_dtype_lie",
        "zarr_fifo_root_json",
        "zarr_foreign_chunk_shape_2p60",
        "zarr_meta_dtype_lie",
        "zarr_symlink_chunk_outside",
        "zarr_symlink_array_outside",
        "zarr_fifo_chunk",  # sources/zarr_decode.py opens chunks O_NONBLOCK and refuses non-files
    }
)


def _bug_for(name: str) -> str | None:
    """The known bug that makes case ``name`` fail the refusal test, if any."""
    if name in _FIXED:
        return None
    for suffix in (
        "meta_deep_nesting",
        "meta_infinity",
        "meta_bad_dtype_string",
        "meta_treedef_unknown_type",
    ):
        if name.endswith(suffix):
            return BUGS[suffix]
    if name in BUGS:
        return BUGS[name]
    if name in _FIFO_WHERE:
        return BUGS["fifo"].format(where=_FIFO_WHERE[name])
    if name.startswith("npy_data_truncated_") or name in (
        "npy_foreign_data_truncated",
        "npy_single_data_truncated",
        "npy_header_shape_2p60_single",
        "npy_header_shape_2p60_meta",
    ):
        return BUGS["npy_short_data"]
    if name == "npy_header_negative_shape_single":
        return BUGS["npy_negative_shape"]
    if name == "npy_header_deep_unary":
        return BUGS["npy_deep_unary"]
    if name == "zarr_chunk_truncated_04":
        return BUGS["zarr_padding_truncated"]
    if name.startswith("zarr_chunk_truncated_"):
        return BUGS["zarr_short_chunk"]
    if name.startswith("zarr_zstd_chunk_") or name == "zarr_chunks_lie_smaller":
        return BUGS["zarr_codec_error"]
    if name.startswith("zarr_array_json_"):
        return BUGS["zarr_array_json"]
    if name == "zarr_foreign_chunk_shape_2p60":
        return BUGS["zarr_giant_chunk"]
    return None


MISSING_OPT_IN = (
    "MISSING: references out of the store are followed silently ({how}). Sources (and "
    "gr.open_source) need allow_external=False by default, refusing with InvalidStoreError "
    "naming the file, the leaf and the fix 'pass allow_external=True if you trust it'. "
    "Detect: {detect}."
)
_H5_DETECT = (
    "for every leaf's HDF5 object, f.get(loc, getlink=True) is an h5py.ExternalLink (also for "
    "parent groups; and in the foreign visit, iterate links with f.visititems_links or "
    "f[group].items() with getlink=True, since visititems skips external links), "
    "dset.is_virtual, or dset.external is not None; with allow_external=True, memory-map only "
    "when dset.file.filename == the store path"
)
_FS_DETECT = (
    "os.path.realpath of every file the source opens (metadata, each .npy, each zarr.json and "
    "each chunk file) and of every directory walked must start with os.path.realpath(store "
    "root) + os.sep"
)
EXTERNAL: dict[str, str] = {
    "hdf5_external_link": MISSING_OPT_IN.format(
        how="worse: hdf5.py maps the STORE file at the link target's offset (np.memmap("
        "source.path, offset=dset.id.get_offset())), so obs reads bytes of the wrong file",
        detect=_H5_DETECT,
    ),
    "hdf5_external_link_foreign": MISSING_OPT_IN.format(
        how="in a foreign file the linked leaf is silently dropped (visititems does not "
        "traverse external links): the user gets a store without 'obs' and no word",
        detect=_H5_DETECT,
    ),
    "hdf5_virtual_dataset": MISSING_OPT_IN.format(
        how="a virtual dataset reads outside.h5 through h5py", detect=_H5_DETECT
    ),
    "hdf5_external_storage": MISSING_OPT_IN.format(
        how="create_dataset(external=[(outside.bin, 0, n)]) reads any file on the host, "
        "e.g. /etc/shadow bytes as float32",
        detect=_H5_DETECT,
    ),
    "npy_symlink_leaf_outside": MISSING_OPT_IN.format(
        how="obs.npy -> outside file is memory-mapped", detect=_FS_DETECT
    ),
    "npy_symlink_dir_outside": MISSING_OPT_IN.format(
        how="obs/ -> outside directory is read", detect=_FS_DETECT
    ),
    "npy_symlink_meta_outside": MISSING_OPT_IN.format(
        how="grain_replay.json -> outside file is trusted as metadata", detect=_FS_DETECT
    ),
    "npy_symlink_foreign_outside": MISSING_OPT_IN.format(
        how="foreign store: os.walk lists the symlinked obs.npy and it is mapped",
        detect=_FS_DETECT,
    ),
    "zarr_symlink_chunk_outside": MISSING_OPT_IN.format(
        how="a chunk file symlinked outside is mapped", detect=_FS_DETECT
    ),
    "zarr_symlink_array_outside": MISSING_OPT_IN.format(
        how="an array directory symlinked outside is read", detect=_FS_DETECT
    ),
}

SLOW_OR_BIG = {
    **{
        name: BUGS["fifo"].format(where=where)
        for name, where in _FIFO_WHERE.items()
        if name not in _FIXED
    },
}

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


def _params(names: list[str], reasons: dict[str, str | None]) -> list[Any]:
    out = []
    for n in names:
        reason = reasons.get(n)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(n, marks=marks, id=n))
    return out


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


@pytest.mark.parametrize(
    "name", _params(_cases("refuse"), {n: _bug_for(n) for n in hostile.CASE_NAMES})
)
def test_malformed_store_raises_named_grain_replay_error_when_opened_or_read(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    _assert_named_error(corpus[name], answers[name])


@pytest.mark.parametrize("name", _params(list(hostile.CASE_NAMES), SLOW_OR_BIG))
def test_hostile_store_answers_within_a_second_without_crash_or_big_allocation(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    r = answers[name]
    assert r["outcome"] in ("accepted", "raised"), _describe(corpus[name], r)
    assert r["elapsed_s"] < 1.0, _describe(corpus[name], r) + f" took {r['elapsed_s']:.2f} s"
    assert r.get("error_type") != "MemoryError", _describe(corpus[name], r)
    grew = r["peak_rss_growth_mb"]
    assert grew < hostile.RSS_BOUND_MB, f"{name}: peak RSS grew {grew:.0f} MiB"


@pytest.mark.parametrize(
    "name", _params(_cases("external"), {k: v for k, v in EXTERNAL.items() if k not in _FIXED})
)
def test_reference_out_of_store_refused_without_allow_external(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    _assert_named_error(corpus[name], answers[name], "allow_external=True")


_FIXED_WITH_OPT_IN = frozenset(
    {
        "npy_symlink_leaf_outside",
        "npy_symlink_dir_outside",
        "npy_symlink_foreign_outside",
        "npy_symlink_meta_outside",
        "hdf5_external_link",
        "hdf5_external_link_foreign",
        "hdf5_virtual_dataset",
        "hdf5_external_storage",
        "zarr_symlink_chunk_outside",
        "zarr_symlink_array_outside",
    }
)


@pytest.mark.parametrize(
    "name",
    _params(_cases("external"), {k: v for k, v in EXTERNAL.items() if k not in _FIXED_WITH_OPT_IN}),
)
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


@pytest.mark.parametrize("name", _params(_cases("bounded"), {}))
def test_declared_huge_store_answers_within_bounds_when_sparse(
    name: str, corpus: dict[str, hostile.Case], answers: dict[str, dict[str, Any]]
) -> None:
    r = answers[name]
    assert r["outcome"] == "accepted" or r["is_grain_replay_error"], _describe(corpus[name], r)
    if r["outcome"] == "accepted" and "obs_head" in r:
        assert r["obs_head"] == [0.0] * 4 + [1.0] * 4, r["obs_head"]


@pytest.mark.parametrize("name", _params(_cases("accept"), {}))
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


IMPORTS_MODULE = (
    "BUG (code execution): tree._namedtuple_class (grain_replay/tree.py) calls "
    "importlib.import_module(node['module']) with the module named in the store's metadata, "
    "at source construction (ReplaySource._set_layout -> tree.compile_unflatten) and again in "
    "every grain worker (__setstate__). A store whose treedef names a module that is "
    "importable (a .py planted next to the data when cwd is on sys.path, or any installed "
    "module with import side effects, e.g. 'antigravity') runs that module's code on open. "
    "Fix: never import; use sys.modules.get(module) (classes the program already imported), "
    "require issubclass(obj, tuple) and obj._fields == fields, else the stand-in namedtuple."
)


@pytest.mark.parametrize(
    "name",
    _params(
        [n for n in hostile.CASE_NAMES if n.endswith("_namedtuple_imports_module")],
        {},
    ),
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
