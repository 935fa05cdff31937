"""Multi-host training from one replay store: one process per host, checkpoint and resume.

Every host runs this script once. The processes join one JAX job
(``jax.distributed.initialize``), open the same store (a shared file system
path or an object-storage URL), and read it with ``gr.make_data_loader``
(default ``ShardByJaxProcess``: each process reads different batches of one
global permutation, together every record once per epoch). Each host batch of
``--per-host-batch`` records becomes this process's slice of a global
``jax.Array`` (``gr.sharded_device_put``), and a jitted SGD step (linear
regression on the synthetic store) consumes the global batch of
``process_count * per_host_batch`` records; its mean is a collective over every
device of every host.

Checkpoints go to ``--ckpt``: at step k every process writes its iterator state
(the ``get_state()`` bytes of the ``sharded_device_put`` wrapper) to
``<ckpt>/step_<k>/loader_state.<process_index>``, process 0 writes the
parameters, and after a barrier marks the step complete (``COMMITTED``). A
restart with the same ``--ckpt`` resumes from the newest complete step: the
parameters, and each process's loader at the identical next batch, also on
another number of processes if the global batch stays the same (for example 4
processes x ``--per-host-batch 8`` resumed on 2 x 16).

Run it::

    # On each of N hosts (the same store visible from every host):
    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=<i> \\
        python examples/multihost.py --store /shared/replay.h5 --ckpt /shared/ckpt
    # TPU pods, SLURM, Open MPI: let JAX find the cluster
    python examples/multihost.py --auto-init --store gs://bucket/replay.zarr --ckpt /shared/ckpt

    # Locally: 4 processes x 2 CPU devices on 127.0.0.1 (gloo collectives)
    python examples/multihost.py --spawn 4 --local-cpu-devices 2 --ckpt /tmp/ckpt --steps 100
    python examples/multihost.py --spawn 4 --local-cpu-devices 2 --ckpt /tmp/ckpt --steps 200

The second local command resumes at step 100. ``--spawn`` only launches the
processes (with the three environment variables set) and collects their
results; see docs/multihost.md for clusters.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

# jax is imported in run(), after --local-cpu-devices has set XLA_FLAGS.

_COMMIT = "COMMITTED"
_KEEP_CHECKPOINTS = 2


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    job = parser.add_argument_group("the JAX job (flags override the environment)")
    job.add_argument(
        "--coordinator",
        default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        help="host:port of process 0 [JAX_COORDINATOR_ADDRESS]",
    )
    job.add_argument(
        "--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
        help="processes in the job, one per host [JAX_NUM_PROCESSES]",
    )  # fmt: skip
    job.add_argument(
        "--process-id", type=int, default=_env_int("JAX_PROCESS_ID"),
        help="this process's index, 0..num_processes-1 [JAX_PROCESS_ID]",
    )  # fmt: skip
    job.add_argument(
        "--auto-init", action="store_true",
        help="jax.distributed.initialize() without arguments (TPU pods, SLURM, Open MPI)",
    )  # fmt: skip
    job.add_argument(
        "--local-cpu-devices", type=int,
        help="run on N fake CPU devices per process with gloo collectives (local testing)",
    )  # fmt: skip
    job.add_argument(
        "--spawn", type=int, metavar="K",
        help="launch K processes of this script on 127.0.0.1 and wait for them",
    )  # fmt: skip
    job.add_argument("--timeout", type=float, default=600.0, help="--spawn: seconds to wait")
    data = parser.add_argument_group("data and training")
    data.add_argument(
        "--store",
        help="replay store (path or URL); default <ckpt>/replay.h5; a synthetic one if missing",
    )
    data.add_argument("--num-records", type=int, default=4096, help="synthetic store size")
    data.add_argument("--obs-dim", type=int, default=8, help="synthetic store feature size")
    data.add_argument(
        "--per-host-batch", type=int, default=32,
        help="records each process reads per step (global batch = this * processes)",
    )  # fmt: skip
    data.add_argument("--steps", type=int, default=200, help="train until this global step")
    data.add_argument("--learning-rate", type=float, default=0.1)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--workers", type=int, default=0, help="grain worker processes per host")
    data.add_argument("--ckpt", help="checkpoint directory, shared by every host; resumed from")
    data.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    data.add_argument("--log-every", type=int, default=50)
    data.add_argument("--result-json", help="write this process's results here (JSON)")
    args = parser.parse_args(argv)
    for name in ("num_records", "obs_dim", "per_host_batch", "steps", "ckpt_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.spawn is not None and args.spawn <= 0:
        parser.error(f"--spawn must be positive, got {args.spawn}")
    given = [args.coordinator, args.num_processes, args.process_id]
    multi = args.auto_init or args.num_processes not in (None, 1)
    if args.spawn is None and multi:
        if not args.auto_init and None in given:
            parser.error(
                "a multi-process job needs --coordinator, --num-processes and --process-id "
                "(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), or "
                "--auto-init on a cluster JAX can detect"
            )
        if not (args.store or args.ckpt):
            parser.error(
                "a multi-process job needs --store (or --ckpt, to keep the synthetic store in "
                "it): every process must read the same store"
            )
    return args


# -- one process ------------------------------------------------------------------------------


def _init_jax(args: argparse.Namespace) -> Any:
    if args.local_cpu_devices:
        # Must happen before jax is imported: the CPU client reads it once.
        flags = os.environ.get("XLA_FLAGS", "").split()
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={args.local_cpu_devices}")
        os.environ["XLA_FLAGS"] = " ".join(flags)
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    multi = args.auto_init or args.num_processes not in (None, 1)
    if args.local_cpu_devices or (multi and os.environ.get("JAX_PLATFORMS") == "cpu"):
        # CPU devices of different processes talk through gloo (no accelerator fabric).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.auto_init:
        jax.distributed.initialize()
    elif multi:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=300,
        )
    return jax


def make_synthetic_store(path: str, num_records: int, obs_dim: int, seed: int) -> None:
    """Regression data ``target = obs @ w + 0.1 * noise``, with each record's ``id``."""
    import grain_replay as gr

    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((num_records, obs_dim)).astype(np.float32)
    w = rng.standard_normal(obs_dim).astype(np.float32)
    gr.write(
        path,
        {
            "id": np.arange(num_records, dtype=np.int64),
            "obs": obs,
            "target": (obs @ w + 0.1 * rng.standard_normal(num_records)).astype(np.float32),
        },
    )


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.partial.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_checkpoint(ckpt: str) -> int | None:
    """The newest step under ``ckpt`` that every process finished writing."""
    if not os.path.isdir(ckpt):
        return None
    steps = [
        int(name[len("step_") :])
        for name in os.listdir(ckpt)
        if name.startswith("step_") and os.path.exists(os.path.join(ckpt, name, _COMMIT))
    ]
    return max(steps, default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One process of the job: train from the newest checkpoint to ``--steps``."""
    jax = _init_jax(args)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import grain_replay as gr

    pid, nproc = jax.process_index(), jax.process_count()
    local = jax.local_device_count()
    if args.per_host_batch % local:
        raise SystemExit(
            f"--per-host-batch {args.per_host_batch} does not split over this host's {local} "
            f"devices; use a multiple of {local}."
        )
    log = print if pid == 0 else (lambda *a, **k: None)
    log(
        f"{nproc} process(es) x {local} device(s) ({jax.devices()[0].platform}); global batch "
        f"{nproc} x {args.per_host_batch} = {nproc * args.per_host_batch}",
        flush=True,
    )

    tmp = None
    store = args.store
    if store is None:  # single process: a synthetic store beside the checkpoints or in a temp dir
        if args.ckpt is None:
            tmp = tempfile.mkdtemp(prefix="multihost_")
        store = os.path.join(args.ckpt or str(tmp), "replay.h5")
    if pid == 0 and "://" not in store and not os.path.exists(store):
        os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
        make_synthetic_store(store, args.num_records, args.obs_dim, args.seed)
        log(f"wrote a synthetic store of {args.num_records} records to {store}", flush=True)
    multihost_utils.sync_global_devices("store ready")

    source = gr.open_source(store)
    loader = gr.make_data_loader(
        source,
        batch_size=args.per_host_batch,
        seed=args.seed,
        num_epochs=None,
        worker_count=args.workers,
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())

    def to_global(host: dict[str, np.ndarray]) -> dict[str, Any]:
        # Every process holds the same values; each fills its own devices.
        return {
            k: jax.make_array_from_callback(v.shape, replicated, lambda idx, v=v: v[idx])
            for k, v in host.items()
        }

    dim = int(np.prod(source.spec["obs"].shape, dtype=np.int64))
    host_params = {"w": np.zeros(dim, np.float32), "b": np.zeros((), np.float32)}
    batches = gr.sharded_device_put(loader, mesh, prefetch=2)

    start_step = 0
    if args.ckpt:
        # Process 0 decides which checkpoint: a shared file system may show others a lag.
        found = latest_checkpoint(args.ckpt) if pid == 0 else None
        found = int(multihost_utils.broadcast_one_to_all(np.int64(-1 if found is None else found)))
        if found >= 0:
            start_step = found
            step_dir = os.path.join(args.ckpt, f"step_{found}")
            with open(os.path.join(step_dir, "meta.json")) as meta_file:
                meta = json.load(meta_file)
            saved_global = meta["num_processes"] * meta["per_host_batch"]
            if saved_global != nproc * args.per_host_batch:
                raise SystemExit(
                    f"{step_dir} was written by {meta['num_processes']} processes with "
                    f"--per-host-batch {meta['per_host_batch']} (global batch {saved_global}); "
                    "resuming it needs the same global batch. Fix: relaunch with "
                    f"--per-host-batch {saved_global // nproc}"
                    if saved_global % nproc == 0
                    else f"{step_dir} was written by {meta['num_processes']} processes with "
                    f"--per-host-batch {meta['per_host_batch']} (global batch {saved_global}); "
                    f"resuming it needs the same global batch, which {nproc} processes cannot "
                    "split. Fix: relaunch on a process count that divides it, or use a new --ckpt."
                )
            with np.load(os.path.join(step_dir, "params.npz")) as saved:
                host_params = {k: saved[k] for k in host_params}
            # Any process's state resumes every process, on any process count.
            own = pid % meta["num_processes"]
            with open(os.path.join(step_dir, f"loader_state.{own}"), "rb") as state_file:
                batches.set_state(state_file.read())
            log(f"resumed from {step_dir}", flush=True)
    params = to_global(host_params)

    @jax.jit
    def train_step(params: dict[str, Any], batch: dict[str, Any]) -> tuple[Any, Any, Any]:
        def loss_fn(p: dict[str, Any]) -> Any:
            pred = batch["obs"].reshape(batch["obs"].shape[0], -1) @ p["w"] + p["b"]
            return jnp.mean((pred - batch["target"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        params = jax.tree_util.tree_map(lambda p, g: p - args.learning_rate * g, params, grads)
        # A checksum of the global batch's record ids: the same number on every process.
        return params, loss, jnp.sum(batch["id"])

    def save(step: int) -> None:
        step_dir = os.path.join(args.ckpt, f"step_{step}")
        os.makedirs(step_dir, exist_ok=True)
        _write_atomic(os.path.join(step_dir, f"loader_state.{pid}"), batches.get_state())
        if pid == 0:
            buf = io.BytesIO()
            np.savez(buf, **{k: np.asarray(v.addressable_data(0)) for k, v in params.items()})  # type: ignore[arg-type]
            _write_atomic(os.path.join(step_dir, "params.npz"), buf.getvalue())
            meta = {"step": step, "num_processes": nproc, "per_host_batch": args.per_host_batch}
            _write_atomic(os.path.join(step_dir, "meta.json"), json.dumps(meta).encode())
        multihost_utils.sync_global_devices(f"checkpoint {step} written")
        if pid == 0:  # now every file of the step exists: mark it complete, drop old ones
            _write_atomic(os.path.join(step_dir, _COMMIT), b"")
            done = sorted(
                int(n[len("step_") :]) for n in os.listdir(args.ckpt) if n.startswith("step_")
            )
            for old in done:
                if old < step and old not in done[-_KEEP_CHECKPOINTS:]:
                    shutil.rmtree(os.path.join(args.ckpt, f"step_{old}"), ignore_errors=True)
        multihost_utils.sync_global_devices(f"checkpoint {step} committed")

    losses: list[float] = []
    local_ids: list[list[int]] = []
    id_sums: list[int] = []
    t0 = time.perf_counter()
    timed_from = start_step + 1
    with batches:
        for step in range(start_step, args.steps):
            batch = next(batches)
            local_ids.append(
                np.concatenate(
                    [np.asarray(s.data) for s in sorted(batch["id"].addressable_shards,
                                                        key=lambda s: s.index[0].start or 0)]
                ).tolist()
            )  # fmt: skip
            params, loss, id_sum = train_step(params, batch)
            # Replicated outputs: every process holds the whole value on its own devices.
            losses.append(float(loss.addressable_data(0)))
            id_sums.append(int(id_sum.addressable_data(0)))
            if step == start_step:
                t0 = time.perf_counter()  # compilation stays out of the rate
            if args.log_every and (step % args.log_every == 0 or step == start_step):
                log(f"step {step:5d}  loss {losses[-1]:.4f}", flush=True)
            if args.ckpt and ((step + 1) % args.ckpt_every == 0 or step + 1 == args.steps):
                save(step + 1)
    elapsed = time.perf_counter() - t0
    timed = args.steps - timed_from
    result = {
        "process_index": pid,
        "process_count": nproc,
        "local_devices": local,
        "global_devices": jax.device_count(),
        "global_batch": nproc * args.per_host_batch,
        "store": store,
        "start_step": start_step,
        "end_step": args.steps,
        "losses": losses,
        "local_ids": local_ids,
        "id_sums": id_sums,
        "steps_per_s": timed / elapsed if timed > 0 and elapsed > 0 else None,
    }
    if losses:
        log(
            f"steps {start_step}..{args.steps}: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + (f", {result['steps_per_s']:.1f} steps/s" if result["steps_per_s"] else ""),
            flush=True,
        )
    multihost_utils.sync_global_devices("done")
    # Not a bare jax.distributed.shutdown(): it can leave a peer's collective waiting
    # at exit (~150 s); see docs/multihost.md, "Leaving the job".
    gr.shutdown_distributed()
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


# -- launching K local processes ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip_spawn(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--spawn", "--timeout", "--result-json"):
            skip = True
        elif not a.startswith(("--spawn=", "--timeout=", "--result-json=")):
            out.append(a)
    return out


def spawn(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Runs ``args.spawn`` processes of this script on 127.0.0.1 and gathers their results."""
    k = args.spawn
    with tempfile.TemporaryDirectory(prefix="multihost_spawn_") as tmp:
        child = _strip_spawn(argv)
        if not args.local_cpu_devices:
            child += ["--local-cpu-devices", "2"]
        if not args.store:  # process 0 writes it; beside the checkpoints to resume with it
            child += ["--store", os.path.join(args.ckpt or tmp, "replay.h5")]
        env = dict(os.environ)
        env.update(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}",
            JAX_NUM_PROCESSES=str(k),
            JAX_PLATFORMS="cpu",
        )
        outs = [os.path.join(tmp, f"result.{i}.json") for i in range(k)]
        logs = [os.path.join(tmp, f"log.{i}.txt") for i in range(k)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i in range(k):
                cmd = [sys.executable, os.path.abspath(__file__), *child, "--result-json", outs[i]]
                with open(logs[i], "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            cmd, env={**env, "JAX_PROCESS_ID": str(i)}, stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )  # fmt: skip
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break  # one failed (the others would wait for it) or too slow
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        with open(logs[0], errors="replace") as f:
            sys.stdout.write(f.read())
        codes = [p.returncode for p in procs]
        if codes != [0] * k:
            report = []
            for i in range(k):
                with open(logs[i], errors="replace") as f:
                    report.append(f"--- process {i} (exit {codes[i]}) ---\n{f.read()[-4000:]}")
            raise RuntimeError(
                f"multihost job failed or timed out after {args.timeout:.0f}s:\n"
                + "\n".join(report)
            )
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
    first = results[0]
    return {
        "processes": results,
        "process_count": k,
        "global_devices": first["global_devices"],
        "start_step": first["start_step"],
        "end_step": first["end_step"],
        "losses": first["losses"],
        "steps_per_s": first["steps_per_s"],
        # Record ids of each global step, every process's share together.
        "global_ids": [
            sorted(i for r in results for i in r["local_ids"][s])
            for s in range(len(first["losses"]))
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses ``argv`` (default: ``sys.argv[1:]``); runs one process, or spawns ``--spawn``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.spawn is not None:
        return spawn(args, argv)
    result = run(args)
    if args.result_json:
        _write_atomic(args.result_json, json.dumps(result).encode())
    return result


if __name__ == "__main__":
    main()
