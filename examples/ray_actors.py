"""N Ray actors writing one bounded store, one JAX learner paced by ``gr.RateLimit``.

``--actors N`` Ray actors each step a small numpy environment (a point on a
plane, pushed by one of two actions towards or away from the origin) epsilon-greedily
with the newest parameters the learner published, and append every transition to one
bounded store through a ``gr.ReplayWriter`` of its own, ``writer_id="actor-<k>"``,
made inside the actor's process (a writer is never pickled across: each actor opens
its own in ``__init__``), committing every ``--flush-every`` steps. Each row carries
its identity (``actor``, ``step``) and the version of the parameters that played it
(``policy_version``).

The learner is this process, Ray's driver: ``gr.open_source(store, wait=...)`` and
``gr.make_data_loader(..., sampling=gr.UniformReplay(rate_limit=limit))`` (or
``gr.PrioritizedReplay`` with ``--sampling prioritized``), one jitted TD(0) step of a
linear Q function per batch. JAX runs in the driver only: the actors import numpy
and grain_replay, never JAX, so they start fast and hold no XLA thread pool, and the
learner is where the accelerator is without asking Ray for one (a learner actor
would need the device as a Ray resource and its results shipped back). The learner
publishes its parameters to a small Ray actor (``ParamServer``, no CPU) every
``--publish-every`` updates; the actors fetch them before each chunk of steps.

The pacing is the library's, one ``gr.RateLimit(min_size, samples_per_insert)`` on
both sides: each actor's writer declares it in the store before its first row, so
the actors hold in ``flush()`` from the start (at ``min_size + tolerance /
samples_per_insert`` rows before any learner), the learner waits when it is ahead
of ``samples_per_insert`` rows sampled per row inserted, and the actors wait when
they are ahead of it (docs/rate_limits.md). After each batch the learner reads the
limiter's counters from its iterator's state (``get_state()``'s ``rate_limit``:
rows handed out, rows inserted as last counted) and logs them; the last lines
printed say how close the run came to the ceiling.

Ray starts a local instance of its own (``address="local"``: never another
cluster), with ``--num-cpus`` CPUs (default: one per actor), no dashboard and usage
statistics off, its node address 127.0.0.1 so that every server of Ray's listens on
loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set before ``import ray``);
``ray.shutdown()`` ends it, on errors too.

``--store`` is a path, or a URL with ``--storage-options`` (JSON, given to the
writers and to ``gr.open_source``) where the package's writers take one.

Run it (Ray lives in a venv of its own: ``make test-ray`` makes ``.venv-ray``)::

    .venv-ray/bin/python examples/ray_actors.py --actors 4 --rows-per-actor 5000 \\
        --store /tmp/ray_store --report /tmp/ray_report.json

The last line printed is ``rows <R> from <N> actors in <s> s: <rows/s> rows/s``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

import grain_replay as gr

OBS_DIM, ACTIONS = 4, 2
EPISODE_STEPS = 64
LEAVES = ("obs", "action", "reward", "next_obs", "done")
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node IP is 127.0.0.1


# ---------------------------------------------------------------------------
# The actors' side (numpy only)


def init_params() -> dict[str, np.ndarray]:
    """A linear Q function, all zeros: the first policy is the epsilon-greedy tie."""
    return {"w": np.zeros((OBS_DIM, ACTIONS), np.float32), "b": np.zeros(ACTIONS, np.float32)}


class ParamServer:
    """The learner's newest parameters and their version (a Ray actor, no CPU)."""

    def __init__(self) -> None:
        self.version, self.params = 0, init_params()

    def publish(self, version: int, params: dict[str, np.ndarray]) -> None:
        self.version, self.params = version, params

    def latest(self) -> tuple[int, dict[str, np.ndarray]]:
        return self.version, self.params


class Actor:
    """One actor (a Ray actor): its own environment, policy and ``ReplayWriter``."""

    def __init__(self, k: int, cfg: dict[str, Any]) -> None:
        self.k, self.cfg = k, cfg
        options = cfg["storage_options"]
        # Made here, in the actor's process: a writer holds a lock and file handles
        # and is never pickled across processes.
        self.writer = gr.ReplayWriter(
            cfg["store"],
            format="npy",
            capacity=cfg["rows_per_actor"],  # every row stays: no eviction in this example
            writer_id=f"actor-{k}",
            rate_limit=gr.RateLimit(**cfg["limit"]),  # declared in the store before any row
            **({"storage_options": options} if options else {}),
        )
        self.rng = np.random.default_rng([cfg["seed"], k])

    def ready(self) -> str:
        """The writer is open (the driver waits for every actor's before its loader)."""
        return f"actor-{self.k}"

    def run(self, server: Any) -> dict[str, Any]:
        """Plays ``rows_per_actor`` steps; returns the writer's counts and its commit log."""
        import ray

        cfg, rng = self.cfg, self.rng
        quota, flush_every, epsilon = cfg["rows_per_actor"], cfg["flush_every"], cfg["epsilon"]
        obs, t = self._reset(), 0
        commits: list[tuple[float, int]] = []  # (time after the flush, rows committed)
        started = time.monotonic()
        step = 0
        try:
            while step < quota:
                version, params = ray.get(server.latest.remote())
                n = min(flush_every, quota - step)
                rows: dict[str, list[Any]] = {k: [] for k in LEAVES}
                for _ in range(n):
                    if rng.random() < epsilon:
                        action = int(rng.integers(ACTIONS))
                    else:
                        action = int(np.argmax(obs @ params["w"] + params["b"]))
                    push = 0.1 if action else -0.1
                    noise = 0.05 * rng.standard_normal(OBS_DIM)
                    next_obs = (0.9 * obs + push + noise).astype(np.float32)
                    t += 1
                    done = t >= EPISODE_STEPS
                    for key, value in zip(
                        LEAVES, (obs, action, -float(np.mean(next_obs**2)), next_obs, done)
                    ):
                        rows[key].append(value)
                    obs = next_obs
                    if done:
                        obs, t = self._reset(), 0
                self.writer.append(
                    {
                        "actor": np.full(n, self.k, np.int32),
                        "step": np.arange(step, step + n, dtype=np.int64),
                        "policy_version": np.full(n, version, np.int64),
                        "obs": np.stack(rows["obs"]),
                        "action": np.array(rows["action"], np.int32),
                        "reward": np.array(rows["reward"], np.float32),
                        "next_obs": np.stack(rows["next_obs"]),
                        "done": np.array(rows["done"], np.bool_),
                    }
                )
                self.writer.flush()  # may wait for the learner: the rate limit
                commits.append((time.monotonic(), self.writer.committed))
                step += n
            return {
                "writer_id": f"actor-{self.k}",
                "committed": self.writer.committed,
                "flushes": len(commits),
                "rate_limit_wait_s": self.writer.rate_limit_wait_s,
                "seconds": time.monotonic() - started,
                "commits": commits,
            }
        finally:
            self.writer.close()

    def _reset(self) -> np.ndarray:
        return self.rng.uniform(-1.0, 1.0, OBS_DIM).astype(np.float32)


# ---------------------------------------------------------------------------
# The learner (this process: the only one that imports JAX)


def make_td_step(learning_rate: float, gamma: float) -> Any:
    """One SGD step of the (importance-weighted) TD(0) loss; returns ``|TD error|`` too."""
    import jax
    import jax.numpy as jnp

    def q_values(params: Any, obs: jax.Array) -> jax.Array:
        return obs @ params["w"] + params["b"]

    def loss(params: Any, data: Any, weight: jax.Array) -> Any:
        q = q_values(params, data["obs"])
        q_sa = jnp.take_along_axis(q, data["action"].astype(jnp.int32)[:, None], axis=1)[:, 0]
        q_next = jnp.max(q_values(params, data["next_obs"]), axis=1)
        done = data["done"].astype(jnp.float32)
        y = data["reward"] + gamma * (1.0 - done) * jax.lax.stop_gradient(q_next)
        delta = q_sa - y
        return jnp.mean(weight * delta**2), delta

    @jax.jit
    def step(params: Any, data: Any, weight: Any) -> Any:
        (value, delta), grads = jax.value_and_grad(loss, has_aux=True)(params, data, weight)
        params = jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads)
        return params, value, jnp.abs(delta)

    return step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--actors", type=int, default=4, help="Ray actors, one writer each")
    parser.add_argument("--rows-per-actor", type=int, default=5_000, help="steps of each actor")
    parser.add_argument("--flush-every", type=int, default=50, help="actor commit interval")
    parser.add_argument(
        "--store", help="path or URL of the store (default: a temporary directory, removed)"
    )
    parser.add_argument(
        "--storage-options", type=json.loads, default=None, help="JSON: fsspec options of a URL"
    )
    parser.add_argument("--sampling", choices=("uniform", "prioritized"), default="uniform")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--min-size", type=int, default=500, help="rows before learning")
    parser.add_argument(
        "--samples-per-insert", type=float, default=4.0, help="sampled rows per inserted row"
    )
    parser.add_argument("--tolerance", type=float, default=None, help="rows (None: default)")
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--gamma", type=float, default=0.9)
    parser.add_argument("--epsilon", type=float, default=0.1, help="the actors' exploration")
    parser.add_argument("--publish-every", type=int, default=50, help="updates between publishes")
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray's (default: --actors)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds either side may wait for the other"
    )
    parser.add_argument("--report", help="write the run's counts and logs here (JSON)")
    args = parser.parse_args(argv)
    positive = ("actors", "rows_per_actor", "flush_every", "batch_size", "publish_every")
    for name in positive:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.min_size < args.actors * args.rows_per_actor:
        parser.error(
            f"--min-size {args.min_size} must be in [0, {args.actors * args.rows_per_actor}) "
            "(the rows of all actors)"
        )
    rows = args.actors * args.rows_per_actor
    if math.floor(args.samples_per_insert * (rows - args.min_size) / args.batch_size) < 1:
        parser.error(
            f"--samples-per-insert {args.samples_per_insert:g} x ({rows} rows - --min-size "
            f"{args.min_size}) is less than one --batch-size {args.batch_size}: no update"
        )
    if args.storage_options is not None and not isinstance(args.storage_options, dict):
        parser.error(f"--storage-options must be a JSON object, got {args.storage_options!r}")
    if args.num_cpus is not None and args.num_cpus < 1:
        parser.error(f"--num-cpus must be positive, got {args.num_cpus}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the actors and the learner; returns the run's summary (also printed)."""
    args = parse_args(argv)
    # Ray's servers on loopback only. Ray 2.60 reads this when ``ray`` is first imported
    # (ray/_private/ray_constants.py: ENABLE_RAY_CLUSTER); off, the node's IP is
    # 127.0.0.1 (services.get_node_ip_address) and its GCS, raylet, object manager,
    # workers and runtime-env agent listen there. On, Linux's default, ray.init turns
    # even ``_node_ip_address="127.0.0.1"`` into the machine's address
    # (services.resolve_ip_for_localhost) and they listen on every interface.
    os.environ[LOOPBACK_ENV] = "0"
    try:
        import ray
    except ImportError:
        raise SystemExit(
            "ray is not installed here. Fix: `make test-ray` makes .venv-ray (Python 3.11, ray "
            "and this package); run .venv-ray/bin/python examples/ray_actors.py"
        ) from None
    tmp = None
    if args.store is None:
        tmp = tempfile.mkdtemp(prefix="ray_actors_")
        args.store = os.path.join(tmp, "replay")
    elif "://" not in args.store:
        args.store = os.path.abspath(args.store)  # the actors' working directory is Ray's
    # No usage statistics (Ray would send them out), and a local instance of its own.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.monotonic()
    ray.init(
        address="local",
        num_cpus=args.num_cpus or args.actors,
        include_dashboard=False,
        configure_logging=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        node_ip = ray.util.get_node_ip_address()
        if node_ip != "127.0.0.1":  # ray was imported before the variable was set
            raise RuntimeError(
                f"Ray's node address is {node_ip}, not 127.0.0.1: its servers would listen "
                f"beyond this machine. Fix: set {LOOPBACK_ENV}=0 before ray is first "
                "imported (run this script as a program, not after `import ray`)"
            )
        return _run(args, ray, started)
    finally:
        ray.shutdown()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, ray: Any, started: float) -> dict[str, Any]:
    import jax

    limit = {
        "min_size": args.min_size,
        "samples_per_insert": args.samples_per_insert,
        "tolerance": args.tolerance,
        "timeout": args.timeout,  # each side's own wait: a dead peer ends the run with an error
    }
    cfg = {
        "store": args.store,
        "storage_options": args.storage_options,
        "rows_per_actor": args.rows_per_actor,
        "flush_every": args.flush_every,
        "epsilon": args.epsilon,
        "seed": args.seed,
        "limit": limit,
    }
    total = args.actors * args.rows_per_actor
    batch = args.batch_size
    # The learner's updates: all the rows' worth, r * (total - min_size) rows sampled.
    # The closed learner's count still holds the actors (the store declares the limit),
    # and it leaves room for the rows the actors have left (the tolerance).
    updates_total = math.floor(args.samples_per_insert * (total - args.min_size) / batch)
    td_step = make_td_step(args.learning_rate, args.gamma)
    params = jax.device_put(init_params())
    zeros = {k: np.zeros((batch, *s), d) for k, (s, d) in _leaf_specs().items()}
    jax.block_until_ready(td_step(params, zeros, np.ones(batch, np.float32)))  # compile first

    server = ray.remote(num_cpus=0)(ParamServer).remote()
    actor_cls = ray.remote(num_cpus=1)(Actor)
    actors = [actor_cls.remote(k, cfg) for k in range(args.actors)]
    ray.get([a.ready.remote() for a in actors])  # every writer is open
    actors_started = time.monotonic()
    runs = [a.run.remote(server) for a in actors]

    rate = gr.RateLimit(**limit)
    if args.sampling == "prioritized":
        sampling: Any = gr.PrioritizedReplay(alpha=0.6, beta=0.4, rate_limit=rate)
    else:
        sampling = gr.UniformReplay(rate_limit=rate)
    source = gr.open_source(
        args.store, wait=args.timeout, storage_options=args.storage_options
    )  # waits for the first commit
    loader = gr.make_data_loader(
        source, batch_size=batch, num_epochs=None, seed=args.seed, sampling=sampling
    )
    log: list[tuple[float, int, int]] = []  # (time after the batch, sampled, inserted)
    losses: list[float] = []
    it = iter(loader)
    first_batch_s = None
    try:
        for update in range(1, updates_total + 1):
            got = next(it)  # waits while the learner is ahead of the actors
            now = time.monotonic()
            counts = json.loads(it.get_state())["rate_limit"]
            log.append((now, counts["sampled"], counts["inserted"]))
            if first_batch_s is None:
                first_batch_s = now - actors_started
                tolerance = float(counts["tolerance"])
            if args.sampling == "prioritized":
                data, weight = got.data, got.weight
            else:
                data, weight = got, np.ones(batch, np.float32)
            params, loss, td = td_step(params, {k: data[k] for k in LEAVES}, weight)
            if args.sampling == "prioritized":
                it.update_priorities(got.index, td)
            if update % args.publish_every == 0:
                losses.append(float(loss))
                # waited for: once a batch past this one is handed out, every actor that
                # asks gets these parameters or newer
                ray.get(server.publish.remote(update, jax.device_get(params)))
            if update % 200 == 0:
                done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
                for ref in done:
                    ray.get(ref)  # an actor that failed: its error, now
    finally:
        it.close()  # the store declares the limit: its count goes on holding the actors
    reports = ray.get(runs, timeout=args.timeout)
    learned_s = time.monotonic() - actors_started
    committed = sum(r["committed"] for r in reports)
    last_commit = max(r["commits"][-1][0] for r in reports if r["commits"])
    rows_s = max(last_commit - actors_started, 1e-9)
    r, m = args.samples_per_insert, args.min_size
    above = max(s - (r * (i - m) + tolerance) for _, s, i in log)  # <= 0: under the ceiling
    result = {
        "actors": args.actors,
        "rows": committed,
        "updates": len(log),
        "sampled": log[-1][1],
        "inserted": log[-1][2],
        "samples_per_insert": r,
        "min_size": m,
        "tolerance": tolerance,
        "batch_size": batch,
        "startup_s": actors_started - started,  # ray.init, JAX's compile, every writer open
        "first_batch_s": first_batch_s,
        "rows_s": committed / rows_s,
        "actors_s": rows_s,
        "learner_s": learned_s,
        "total_s": time.monotonic() - started,
        "max_above_ceiling": above,
        "loss_first_last": [losses[0], losses[-1]] if losses else None,
        "rate_limit_wait_s": {x["writer_id"]: x["rate_limit_wait_s"] for x in reports},
    }
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump({**result, "learner_log": log, "actors_log": reports}, f)
    print(json.dumps(result))
    print(
        f"learner: {len(log)} updates, {log[-1][1]} rows sampled of {log[-1][2]} inserted; "
        f"sampled - (r * (inserted - min_size) + tolerance), the most over its batches: "
        f"{above:+.0f} rows (<= 0: within the limit)"
    )
    print(
        f"rows {committed} from {args.actors} actors in {rows_s:.1f} s: "
        f"{committed / rows_s:.0f} rows/s"
    )
    return result


def _leaf_specs() -> dict[str, tuple[tuple[int, ...], Any]]:
    return {
        "obs": ((OBS_DIM,), np.float32),
        "action": ((), np.int32),
        "reward": ((), np.float32),
        "next_obs": ((OBS_DIM,), np.float32),
        "done": ((), np.bool_),
    }


if __name__ == "__main__":
    main()
