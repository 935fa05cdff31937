"""examples/ray_actors.py: 4 Ray actors and a JAX learner on one store, paced by gr.RateLimit.

Ray lives in a venv of its own: ``make test-ray`` creates it (``.venv-ray/``, Python 3.11,
ray and this package) and sets ``RAY_PYTHON``; the script runs there, and this process
(the main venv) checks the store it leaves and the counts it reports. Without
``RAY_PYTHON`` those tests skip; the argument checks need no Ray and run everywhere.
"""

from __future__ import annotations

import bisect
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "ray_actors.py"
RAY_PYTHON = os.environ.get("RAY_PYTHON", "")
needs_ray = pytest.mark.skipif(
    not (RAY_PYTHON and os.access(RAY_PYTHON, os.X_OK)),
    reason="needs ray: run `make test-ray` (creates .venv-ray, sets RAY_PYTHON)",
)
ACTORS, ROWS, FLUSH, BATCH, MIN_SIZE, R = 4, 1500, 50, 32, 500, 4.0
LAST = re.compile(r"rows (\d+) from (\d+) actors in ([\d.]+) s: (\d+) rows/s")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(SCRIPT.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(python: str, *args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


# A TCP socket bound to IPv4's loopback: an AF_INET one, or an AF_INET6 one (as gRPC
# makes them) bound to the IPv4-mapped form, which takes connections to 127.0.0.1 only.
LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1")
HAS_PROC_NET = Path("/proc/net/tcp").exists()


def _listening(text: str, ipv6: bool) -> dict[str, tuple[str, int]]:
    """``/proc/net/tcp`` (or ``tcp6``) text: inode -> (address, port) of each listening socket."""
    found = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != "0A":  # 0A: TCP_LISTEN
            continue
        address, port = fields[1].split(":")
        raw = bytes.fromhex(address)
        if sys.byteorder == "little":  # the kernel prints each 32-bit word in host order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
        family = socket.AF_INET6 if ipv6 else socket.AF_INET
        found[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def _process_tree(root: int) -> list[int]:
    """``root`` and every process below it (``/proc/<pid>/stat``'s parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path("/proc", entry, "stat").read_text()
            except OSError:  # gone since the listing
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])  # after the name: state, ppid
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _listeners(root: int) -> set[tuple[str, str, int]]:
    """(process name, address, port) of each TCP socket listening in ``root``'s tree."""
    sockets: dict[str, tuple[str, int]] = {}
    for name, ipv6 in (("tcp", False), ("tcp6", True)):
        try:
            sockets.update(_listening(Path("/proc/net", name).read_text(), ipv6))
        except OSError:  # no IPv6 here
            continue
    found = set()
    for pid in _process_tree(root):
        try:
            comm = Path("/proc", str(pid), "comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = link[len("socket:[") : -1] if link.startswith("socket:[") else None
            if inode in sockets:
                found.add((comm, *sockets[inode]))
    return found


def _run_watched(
    tmp_path: Path, python: str, *args: str, timeout: float = 170
) -> tuple[subprocess.CompletedProcess[str], set[tuple[str, str, int]]]:
    """``_run``, and every TCP socket its process tree listened on while it ran (Linux)."""
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    seen: set[tuple[str, str, int]] = set()
    deadline = time.monotonic() + timeout
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [python, str(SCRIPT), *args], stdout=stdout, stderr=stderr, text=True, env=_env()
        )
        while True:
            if HAS_PROC_NET:
                seen |= _listeners(proc.pid)
            try:
                proc.wait(timeout=0.25)  # the pace of the look, not a synchronisation
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())
    return done, seen


def _at(times: list[float], values: list[Any], when: float, before: Any) -> Any:
    """The last of ``values`` logged at or before ``when`` (``before`` if none)."""
    i = bisect.bisect_right(times, when)
    return values[i - 1] if i else before


def _check_run(
    tmp_path: Path, sampling: str, actors: int, rows: int, flush: int, min_size: int
) -> None:
    """Runs the script; checks its exit, the store's rows and both sides' counts."""
    store, report = tmp_path / "store", tmp_path / "report.json"
    done, listening = _run_watched(
        tmp_path,
        RAY_PYTHON,
        *f"--actors {actors} --rows-per-actor {rows} --flush-every {flush}".split(),
        *f"--batch-size {BATCH} --min-size {min_size} --samples-per-insert {R}".split(),
        *["--sampling", sampling, "--store", str(store), "--report", str(report)],
        *["--timeout", "60", "--publish-every", "10"],
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    last = LAST.fullmatch(done.stdout.strip().splitlines()[-1])
    assert last, done.stdout
    assert (int(last.group(1)), int(last.group(2))) == (actors * rows, actors)
    if HAS_PROC_NET:
        # Ray's servers were seen (its GCS and raylet listen from ray.init to
        # ray.shutdown), and every socket of the run's processes listened on loopback only.
        assert {"gcs_server", "raylet"} <= {name for name, _, _ in listening}, listening
        beyond = sorted(s for s in listening if s[1] not in LOOPBACK)
        assert not beyond, f"listening beyond 127.0.0.1: {beyond} (all: {sorted(listening)})"

    # Every row each actor committed is in the store, exactly once, whole.
    replay = gr.open_source(str(store))
    ids = [f"actor-{k}" for k in range(actors)]
    assert sorted(m.writer_id for m in replay.writers) == ids
    committed = [m.committed for m in sorted(replay.writers, key=lambda m: m.writer_id)]
    assert committed == [rows] * actors
    assert len(replay) == actors * rows  # capacity = the quota: nothing evicted
    got = replay.read_batch(np.arange(len(replay)))
    pairs = np.stack([got["actor"], got["step"]], axis=1)
    assert len(np.unique(pairs, axis=0)) == len(pairs)
    want = np.array([(k, s) for k in range(actors) for s in range(rows)])
    np.testing.assert_array_equal(np.unique(pairs, axis=0), want)
    for k in range(actors):
        mine = got["actor"] == k
        # the learner's parameters reached every actor: its last chunk was played after
        # its previous flush, which the limit let through only once the learner had handed
        # out r * (own rows - min_size) - tolerance rows, > 10 batches (published, waited for)
        assert got["policy_version"][mine].max() >= 1, k
        # whole rows: within an episode a row's obs is the previous row's next_obs
        order = np.argsort(got["step"][mine])
        obs, nxt = got["obs"][mine][order], got["next_obs"][mine][order]
        cont = ~got["done"][mine][order][:-1]
        np.testing.assert_array_equal(obs[1:][cont], nxt[:-1][cont])

    # The learner's samples per insert stayed within the limit's band, every batch.
    out = json.loads(report.read_text())
    e, log = out["tolerance"], out["learner_log"]
    assert e == max(0.1 * min_size * R, 2 * BATCH, BATCH + R)  # the default tolerance
    updates = int(R * (actors * rows - min_size) // BATCH)
    assert out["updates"] == len(log) == updates
    times = [t for t, _, _ in log]
    sampled = [s for _, s, _ in log]
    assert sampled == [BATCH * (t + 1) for t in range(updates)]
    assert times == sorted(times)
    inserted = [i for _, _, i in log]
    assert inserted == sorted(inserted) and inserted[-1] <= actors * rows
    for s, i in zip(sampled, inserted):
        # the ceiling, exact: the limiter's own count of inserted rows when it let the draw go
        assert s <= R * (i - min_size) + e, (s, i)
    assert out["max_above_ceiling"] <= 0
    # The floor, from the two sides' logs on one clock: when an actor's flush returned, the
    # rows committed by then (each actor's, as logged) were not ahead of the rows handed
    # out by then by more than the tolerance, plus what docs/rate_limits.md allows: one
    # flush of each actor (those committing at the same instant, each checked before the
    # others commit; the flush that crosses min_size, never held) and one batch (logged
    # just after it was handed out). A writer that ignored the limit would be thousands
    # of rows ahead.
    slack = e + BATCH + R * actors * flush
    commits = {a["writer_id"]: a["commits"] for a in out["actors_log"]}
    assert sorted(commits) == ids
    for a in out["actors_log"]:
        assert a["committed"] == rows and a["flushes"] == math.ceil(rows / flush)
    clocks = {w: ([t for t, _ in c], [n for _, n in c]) for w, c in commits.items()}
    for c in commits.values():
        for when, _ in c:
            total = sum(_at(ts, ns, when, 0) for ts, ns in clocks.values())
            handed = _at(times, sampled, when, 0)
            assert R * (total - min_size) - handed <= slack, (when, total, handed)
    assert out["rows"] == actors * rows


@needs_ray
def test_four_ray_actors_commit_every_row_once_within_the_rate_limit(tmp_path: Path) -> None:
    _check_run(tmp_path, "uniform", ACTORS, ROWS, FLUSH, MIN_SIZE)


@needs_ray
def test_prioritized_learner_over_two_ray_actors(tmp_path: Path) -> None:
    _check_run(tmp_path, "prioritized", 2, 330, 40, 100)  # the last flush is short: 10 rows


@needs_ray
def test_an_actor_that_fails_ends_the_run_with_its_error(tmp_path: Path) -> None:
    store = tmp_path / "store"
    # the store already declares another limit: each actor's writer is refused when made
    other = gr.ReplayWriter(
        str(store),
        "npy",
        capacity=10,
        writer_id="other",
        rate_limit=gr.RateLimit(min_size=5, samples_per_insert=1.0),
    )
    other.close()
    args = "--actors 2 --rows-per-actor 300 --min-size 100 --store".split()
    done = _run(RAY_PYTHON, *args, str(store))
    assert done.returncode != 0
    err = done.stderr
    assert "InvalidSamplingError" in err and "Fix:" in err, err[-5000:]
    assert "limit.json" in err, err[-5000:]


@needs_ray
def test_ray_imported_before_the_script_is_refused_before_any_actor(tmp_path: Path) -> None:
    # ray read the variable (on: the machine's address) before main() could set it
    env = {**_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    store = tmp_path / "store"
    code = (
        "import sys, runpy, ray; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    argv = [RAY_PYTHON, "-c", code, str(SCRIPT), "--actors", "1", "--store", str(store)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170, env=env)
    assert done.returncode != 0
    assert "not 127.0.0.1" in done.stderr, done.stderr[-5000:]
    assert "Fix: set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before ray" in done.stderr
    assert not store.exists()  # no actor opened a writer


@pytest.mark.skipif(sys.byteorder != "little", reason="the lines below are a little-endian's")
def test_proc_net_tcp_lines_give_each_listening_socket_its_address() -> None:
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    tail = "00000000:00000000 00:00000000 00000000  1000        0 {} 1 0 100 0 0 10 0"
    tcp = "\n".join(
        [
            head,
            f"   0: 0100007F:1F90 00000000:0000 0A {tail.format(11)}",  # 127.0.0.1:8080
            f"   1: 00000000:0050 00000000:0000 0A {tail.format(12)}",  # 0.0.0.0:80
            f"   2: 0100007F:1F91 0100007F:C350 01 {tail.format(13)}",  # established
        ]
    )
    assert _listening(tcp, ipv6=False) == {"11": ("127.0.0.1", 8080), "12": ("0.0.0.0", 80)}
    mapped, wildcard = "0000000000000000FFFF00000100007F", "0" * 32
    tcp6 = "\n".join(
        [
            head,
            f"   0: {mapped}:A3F5 {'0' * 32}:0000 0A {tail.format(21)}",
            f"   1: {wildcard}:A3F6 {'0' * 32}:0000 0A {tail.format(22)}",
        ]
    )
    got = _listening(tcp6, ipv6=True)
    assert got == {"21": ("::ffff:127.0.0.1", 0xA3F5), "22": ("::", 0xA3F6)}
    assert got["21"][0] in LOOPBACK and got["22"][0] not in LOOPBACK


@pytest.mark.skipif(not HAS_PROC_NET, reason="reads /proc/net/tcp (Linux)")
def test_listeners_finds_a_socket_listening_in_this_process_and_no_other() -> None:
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        before = _listeners(os.getpid())
        server.listen()
        port = server.getsockname()[1]
        client.connect(("127.0.0.1", port))
        accepted, _ = server.accept()
        with accepted:
            found = _listeners(os.getpid())
        # bound, not yet listening: not listed; listening: listed; the two ends of a
        # connection (open sockets, not listening) are not
        assert port not in {p for _, _, p in before}
        me = Path("/proc/self/comm").read_text().strip()
        assert found - before == {(me, "127.0.0.1", port)}


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--actors", "0"], "--actors must be positive, got 0"),
        (["--flush-every", "-1"], "--flush-every must be positive, got -1"),
        (["--min-size", "10000", "--rows-per-actor", "100"], "--min-size 10000 must be in"),
        (["--samples-per-insert", "0.001", "--min-size", "0"], "no update"),
        (["--storage-options", "[1]"], "--storage-options must be a JSON object"),
        (["--num-cpus", "0"], "--num-cpus must be positive"),
    ],
)
def test_bad_arguments_are_refused_before_ray_starts(args: list[str], phrase: str) -> None:
    done = _run(sys.executable, *args, timeout=60)
    assert done.returncode == 2, done.stderr
    assert phrase in done.stderr, done.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is not None, reason="ray is installed in this venv"
)
def test_without_ray_the_script_says_how_to_get_it(tmp_path: Path) -> None:
    done = _run(sys.executable, "--store", str(tmp_path / "s"), timeout=60)
    assert done.returncode == 1
    assert "ray is not installed here. Fix: `make test-ray`" in done.stderr, done.stderr
    assert not (tmp_path / "s").exists()  # nothing made
