"""Section ``device``: host-to-device puts, the loader feeding a training step, resident replay.

For transition and image batches, on whatever backend JAX runs (8 fake CPU
devices under ``run.py`` unless a GPU or TPU is present):

- a bare ``jax.device_put`` of one host batch (pageable numpy), and from pinned host
  memory (``memory_kind="pinned_host"``) where the backend has it;
- ``gr.sharded_device_put`` fed by ``gr.make_data_loader``, with and without
  ``pinned=True`` staging;
- ``gr.sharded_device_put(loader, resident=True)`` on the same store;
- a jitted training step (an MLP on transitions, a small conv net on images) on
  batches already on the devices, fed by the loader, and fed by resident replay:
  the fraction of the step time the input pipeline adds;
- the resident store's device memory: ``memory_stats()["bytes_in_use"]`` after loading
  less before, over the records' bytes (target <= 1.1x: the store's line layout, not
  the TPU's tiles, sets it), in the results' ``resident_hbm`` and a note; jax's CPU
  backend reports no memory stats (None: not measured, the note says so).

The training step runs one model replica per device with no cross-device
reduction: the host CPU backend's in-process collectives can deadlock with
several programs in flight on a loaded machine, and the input pipeline's share
does not depend on the all-reduce. Cases of one dataset are timed in turns (see
:func:`_paired`) so that ratios see the same machine load.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from bench_common import PAGE_CACHE, Case, Config, SectionResult, index_batches, time_steps
from bench_data import Store

import grain_replay as gr

__all__ = ["run_device"]

_SLICES = 6
_DRAIN = 3  # untimed steps before a slice: more than sharded_device_put's prefetch of 2
ON_DEVICE_BATCHES = 8
_WHOLE_BUDGET_S = 15.0  # most seconds a case may take to time whole gather windows
# Targets of issue 17. On CPU only the resident/host ratio has one; the others are
# host-to-device targets, reported as plain numbers where there is no such link.
RESIDENT_CPU_TARGET = 5.0
PUT_VS_PINNED_GPU_TARGET = 0.8
CONV_FED_GPU_TARGET = 1 / 1.05  # the loader adds < 5 % to the conv step
MLP_RESIDENT_GPU_TARGET = 1 / 1.02  # resident replay adds < 2 % to the MLP step
# Issue 41 point 3: the resident store's device memory (memory_stats' bytes_in_use, after
# loading less before) over its records' bytes; the layout's tiles must not inflate it.
RESIDENT_HBM_TARGET = 1.1  # at most


def _bytes_in_use(device: Any) -> int | None:
    """``bytes_in_use`` of ``device.memory_stats()``; None where the backend reports none
    (jax's CPU backend returns None)."""
    stats = device.memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return None
    return int(stats["bytes_in_use"])


def _resident_hbm(
    res: SectionResult,
    ds_name: str,
    records_bytes: int,
    store_bytes: int,
    layout_bytes: int,
    before: int | None,
    after: int | None,
    backend: str,
    log: Callable[[str], None],
) -> None:
    """Records the resident store's device memory against its records' bytes (in the dtypes
    the devices hold; ``store_bytes``: the store's, on the host): the results'
    ``resident_hbm`` and a note (the table), measured where ``memory_stats()`` reports."""
    hbm = None if before is None or after is None else after - before
    ratio = None if hbm is None else hbm / records_bytes
    res.extra.setdefault("resident_hbm", {})[ds_name] = {
        "records_bytes": records_bytes,  # device dtypes
        "store_bytes": store_bytes,  # the store's own dtypes
        "layout_bytes": layout_bytes,  # what the budget counts: the layout, TPU tiles included
        "layout_over_records": layout_bytes / records_bytes,
        "bytes_in_use_before": before,
        "bytes_in_use_after": after,
        "hbm_bytes": hbm,
        "hbm_over_records": ratio,
        "hbm_over_store": None if hbm is None else hbm / store_bytes,
        "target_at_most": RESIDENT_HBM_TARGET,
        "passed": None if ratio is None else ratio <= RESIDENT_HBM_TARGET,
    }
    layout = f"layout {layout_bytes / 2**20:,.1f} MiB ({layout_bytes / records_bytes:.3f}x)"
    if ratio is None:
        line = (
            f"{ds_name}: resident store's device memory: not measured, memory_stats() is None "
            f"on {backend}; records {records_bytes / 2**20:,.1f} MiB in device dtypes "
            f"(store {store_bytes / 2**20:,.1f} MiB), {layout}"
        )
    else:
        assert hbm is not None
        line = (
            f"{ds_name}: resident store's device memory (memory_stats bytes_in_use, after "
            f"loading - before) {hbm / 2**20:,.1f} MiB = {ratio:.3f}x its records' "
            f"{records_bytes / 2**20:,.1f} MiB in device dtypes ({hbm / store_bytes:.3f}x the "
            f"store's {store_bytes / 2**20:,.1f} MiB; target <= {RESIDENT_HBM_TARGET}x: "
            f"{'met' if ratio <= RESIDENT_HBM_TARGET else 'MISSED'}); {layout}"
        )
    res.notes.append(line)
    log(f"  {line}")


def _gpu_target(res: SectionResult, ratio: Any, target: float, on_accelerator: bool) -> None:
    """Records a GPU target with its ratio in ``extra["gpu_targets"]`` on every backend (judged
    only on an accelerator), so that ``accelerator_check.sh`` prints each one, on CPU too."""
    if ratio is None:
        return
    res.extra.setdefault("gpu_targets", []).append(
        {
            "name": ratio.name,
            "value": ratio.value,
            "target": target,
            "judged": on_accelerator,
            "passed": ratio.value >= target if on_accelerator else None,
        }
    )


def _paired(
    cfg: Config,
    names: dict[str, str],
    steps: dict[str, Callable[[int], Any]],
    meta: dict[str, Any],
    whole: dict[str, int],
) -> dict[str, Case]:
    """Times ``steps`` in turns, in ``_SLICES`` slices of each repeat (same load for all).

    A case in ``whole`` hands out batches in groups (resident replay gathers a window of
    batches per dispatch): its slices are whole groups, with no untimed drain steps, so
    that every slice pays its share of the dispatches.
    """
    steps = {m: f for m, f in steps.items() if cfg.wants(names[m])}
    one = dataclasses.replace(cfg, repeats=1, case_budget_s=None)
    per_slice = {}
    for m, step in steps.items():
        k, t = time_steps(step, one, warmup=6, warmup_s=cfg.target_s)
        per_slice[m] = max(1, k // _SLICES)
        rounded = -(-per_slice[m] // whole[m]) * whole[m] if m in whole else 0
        if rounded and rounded * _SLICES * cfg.repeats * t[0] / k <= _WHOLE_BUDGET_S:
            per_slice[m] = rounded
        elif m in whole:  # slow steps (a conv step): whole windows would take minutes
            del whole[m]
            meta["notes"][m] = "slices not aligned to gather windows (slow step)"
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(cfg.repeats):
        total = dict.fromkeys(steps, 0.0)
        for _ in range(_SLICES):
            for m, step in steps.items():
                for _ in range(0 if m in whole else _DRAIN):
                    step(0)
                t0 = time.perf_counter()
                for _ in range(per_slice[m]):
                    step(0)
                total[m] += time.perf_counter() - t0
        for m in steps:
            times[m].append(total[m])
    return {
        m: Case(
            names[m],
            "device",
            meta["dataset"],
            "npy",
            "npy",
            m,
            "pipeline",
            meta["batch"],
            meta["record_bytes"],
            per_slice[m] * _SLICES,
            times[m],
            meta["notes"].get(m, ""),
        )
        for m in steps
    }


def _next(it: Iterator[Any], block: Callable[[Any], Any]) -> Callable[[int], Any]:
    return lambda i: block(next(it))


def _window_copies(batch: Any, window: int) -> Iterator[Any]:
    """The ceiling of any replay that hands out ``window`` batches a dispatch: one jitted
    call returns ``window`` copies of ``batch`` (already on the devices, same leaves,
    dtypes and sharding), handed out one by one. Resident replay makes the same call
    with a gather in it: what this costs the step is what the outputs cost the host (one
    array per leaf per batch), not the gather."""
    import jax
    import jax.numpy as jnp

    # x + 0 of the leaf's own dtype: a copy on the device, a distinct output each
    copies = jax.jit(
        lambda b: tuple(
            jax.tree.map(lambda x, k=k: x + jnp.zeros((), x.dtype) * k, b) for k in range(window)
        )
    )
    while True:
        yield from copies(batch)


# -- models: plain jax, one replica per device ------------------------------------------------


def _mlp_init(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    return {"w1": w(64, 256), "w2": w(256, 256), "w3": w(256, 18)}


def _mlp_loss(p: Any, batch: Any) -> Any:
    import jax
    import jax.numpy as jnp

    h = jax.nn.relu(batch["obs"] @ p["w1"])
    h = jax.nn.relu(h @ p["w2"])
    logp = jax.nn.log_softmax(h @ p["w3"])
    action = jnp.clip(batch["action"].astype(jnp.int32), 0, 17)
    return -jnp.mean(jnp.take_along_axis(logp, action[:, None], axis=1))


def _conv_init(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape: int) -> np.ndarray:
        fan_in = int(np.prod(shape[:-1]))
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    return {"c1": w(8, 8, 4, 16), "c2": w(4, 4, 16, 32), "d1": w(9 * 9 * 32, 256), "d2": w(256, 18)}


def _conv_loss(p: Any, batch: Any) -> Any:
    import jax
    import jax.numpy as jnp

    x = batch["obs"].astype(jnp.float32) / 255.0
    dn = ("NHWC", "HWIO", "NHWC")
    x = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c1"], (4, 4), "VALID", dimension_numbers=dn))
    x = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c2"], (2, 2), "VALID", dimension_numbers=dn))
    x = jax.nn.relu(x.reshape(x.shape[0], -1) @ p["d1"])
    return jnp.mean((x @ p["d2"]) ** 2)


def _make_train_step(loss: Callable[[Any, Any], Any], sharding: Any) -> Callable[[Any, Any], Any]:
    """SGD on one replica per device (params carry a leading device axis), no collectives."""
    import jax
    from jax.sharding import PartitionSpec

    axis = sharding.spec[0]

    def local(params: Any, batch: Any) -> Any:
        p = jax.tree.map(lambda x: x[0], params)
        grads = jax.grad(loss)(p, batch)
        return jax.tree.map(lambda w, g: (w - 1e-3 * g)[None], p, grads)

    spec = PartitionSpec(axis)
    return jax.jit(
        jax.shard_map(local, mesh=sharding.mesh, in_specs=(spec, spec), out_specs=spec),
        donate_argnums=0,
    )


# -- the section ------------------------------------------------------------------------------


def run_device(
    cfg: Config,
    stores: dict[str, dict[str, Store]],
    res: SectionResult,
    log: Callable[[str], None],
) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from grain_replay.device.put import has_pinned_host

    backend = jax.default_backend()
    on_accelerator = backend in ("gpu", "cuda", "rocm", "tpu")
    window = os.environ.get("BENCH_RESIDENT_WINDOW")
    if window:  # a smoke test's knob: the default window's gather compiles for seconds
        from grain_replay.device import resident as resident_module

        resident_module._MAX_WINDOW = int(window)
        res.notes.append(
            f"resident replay gathers at most {int(window)} batches a dispatch "
            "(BENCH_RESIDENT_WINDOW; default 64): not the library's timing"
        )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    pinned_ok = has_pinned_host()
    res.extra["jax"] = {
        "backend": backend,
        "device_count": jax.device_count(),
        "devices": [str(d) for d in jax.devices()[:8]],
        "memory_kinds": sorted({m.kind for m in jax.devices()[0].addressable_memories()}),
    }
    log(f"  jax backend={backend} devices={jax.device_count()} pinned_host={pinned_ok}")
    if not on_accelerator:
        res.notes.append(
            f"backend {backend}: the puts are host memory copies, not host-to-device "
            "transfers; the GB/s columns and the GPU targets apply on an accelerator."
        )
    if not pinned_ok:
        res.notes.append(f"pinned_host memory: not available on {backend}")
    block = jax.block_until_ready
    gbps: dict[str, dict[str, float]] = {}
    fractions: dict[str, dict[str, float]] = {}

    for ds_name, init, loss in (
        ("transitions", _mlp_init, _mlp_loss),
        ("images", _conv_init, _conv_loss),
    ):
        store = stores[ds_name]["npy"]
        ds = store.dataset
        b = cfg.batch_size
        PAGE_CACHE.keep_only([store.path])
        src = gr.open_source(store.path)
        host = src.read_batch(index_batches(ds.n, cfg)[0])
        pinned_host = (
            jax.device_put(host, sharding.with_memory_kind("pinned_host")) if pinned_ok else None
        )
        on_device = [
            jax.device_put(src.read_batch(ids), sharding)
            for ids in index_batches(ds.n, cfg)[1 : 1 + ON_DEVICE_BATCHES]
        ]

        def loader() -> Any:
            return gr.make_data_loader(src, batch_size=b, num_epochs=None, seed=1)  # noqa: B023

        # Resident replay first, while nothing else allocates device memory: its store's
        # bytes are bytes_in_use after loading less before.
        resident_it: Any = None
        gc.collect()
        in_use_before = _bytes_in_use(jax.local_devices()[0])
        t0 = time.perf_counter()
        try:
            resident_it = gr.sharded_device_put(loader(), resident=True)
        except gr.ResidentBudgetError as e:
            res.notes.append(f"{ds_name}: resident replay skipped: {e}")
            log(f"  {ds_name}: resident replay skipped (over budget)")
        else:
            res.extra.setdefault("resident_load_s", {})[ds_name] = time.perf_counter() - t0
            res.extra.setdefault("resident_device_bytes", {})[ds_name] = resident_it.device_bytes
            # The records in the dtypes the devices hold (int64 -> int32 without x64): the
            # ratio is then the layout's own overhead (the store's bytes: store_bytes).
            device_record = sum(
                np.dtype(jax.dtypes.canonicalize_dtype(d)).itemsize * int(np.prod(s))
                for _, d, s in ds.leaves
            )
            _resident_hbm(
                res, ds_name, ds.n * device_record, ds.n * ds.record_bytes,
                resident_it.store_bytes, in_use_before, _bytes_in_use(jax.local_devices()[0]),
                backend, log,
            )  # fmt: skip
        host_it = gr.sharded_device_put(loader())
        pinned_it = gr.sharded_device_put(loader(), pinned=True) if pinned_ok else None

        rng = np.random.default_rng(0)
        params0 = {
            k: np.broadcast_to(v, (len(mesh.devices.flat), *v.shape)).copy()
            for k, v in init(rng).items()
        }
        train = _make_train_step(loss, sharding)
        state = {"p": jax.device_put(params0, sharding)}
        cycle = itertools.cycle(on_device)

        def train_on(batches: Iterator[Any]) -> Callable[[int], Any]:
            def step(i: int) -> Any:
                state["p"] = train(state["p"], next(batches))  # noqa: B023
                return block(state["p"])  # noqa: B023

            return step

        steps: dict[str, Callable[[int], Any]] = {
            "device_put-pageable": lambda i: block(jax.device_put(host, sharding)),  # noqa: B023
        }
        if pinned_host is not None:
            steps["device_put-pinned"] = lambda i: block(jax.device_put(pinned_host, sharding))  # noqa: B023
        steps["sharded_device_put(loader)"] = _next(host_it, block)
        if pinned_it is not None:
            steps["sharded_device_put(loader, pinned)"] = _next(pinned_it, block)
        if resident_it is not None:
            steps["sharded_device_put(loader, resident)"] = _next(resident_it, block)
        steps["step-on-device-batches"] = train_on(cycle)
        steps["step-fed-by-loader"] = train_on(host_it)
        if resident_it is not None:
            steps["step-fed-by-resident"] = train_on(resident_it)
            ceiling_it = _window_copies(on_device[0], resident_it.window)
            steps["step-fed-by-window-copies"] = train_on(ceiling_it)
        notes = {
            "step-fed-by-window-copies": (
                "the resident ceiling: one jitted call returns a window of copies of a "
                "device batch (no gather), handed out one by one"
            ),
            "device_put-pageable": "jax.device_put(numpy batch, batch sharding)",
            "device_put-pinned": "from a pinned_host copy of the batch",
            "sharded_device_put(loader)": "reads the npy store (page cache)",
            "step-on-device-batches": f"{ON_DEVICE_BATCHES} batches put beforehand",
        }
        names = {m: f"device/{ds_name}/npy/{m}" for m in steps}
        meta = {"dataset": ds_name, "batch": b, "record_bytes": ds.record_bytes, "notes": notes}
        window = (
            {}
            if resident_it is None
            else {m: resident_it.window for m in steps if "resident" in m or "window" in m}
        )
        cases = _paired(cfg, names, steps, meta, window)
        for it in (host_it, pinned_it, resident_it):
            if it is not None:
                it.close()
        on_device.clear()
        state.clear()
        gc.collect()
        for c in cases.values():
            res.add(c)

        gbps[ds_name] = {m: c.mb_per_s / 1e3 for m, c in cases.items() if "step" not in m}
        p = f"device/{ds_name}:"
        g = cases.get
        res.ratio(
            f"{p} resident / host pipeline (sharded_device_put(loader))",
            g("sharded_device_put(loader, resident)"), g("sharded_device_put(loader)"),
            RESIDENT_CPU_TARGET if ds_name == "transitions" and not on_accelerator else None,
            "resident",
        )  # fmt: skip
        put = res.ratio(
            f"{p} sharded_device_put(loader) / bare pinned put",
            g("sharded_device_put(loader)"), g("device_put-pinned"),
            PUT_VS_PINNED_GPU_TARGET if ds_name == "images" and on_accelerator else None, "put",
        )  # fmt: skip
        if ds_name == "images":
            _gpu_target(res, put, PUT_VS_PINNED_GPU_TARGET, on_accelerator)
        res.ratio(
            f"{p} pinned staging / pageable (sharded_device_put(loader))",
            g("sharded_device_put(loader, pinned)"), g("sharded_device_put(loader)"), None, "put",
        )  # fmt: skip
        res.ratio(
            f"{p} bare put: pinned / pageable",
            g("device_put-pinned"), g("device_put-pageable"), None, "put",
        )  # fmt: skip
        base = g("step-on-device-batches")
        for fed, target in (
            ("step-fed-by-loader", CONV_FED_GPU_TARGET if ds_name == "images" else None),
            ("step-fed-by-resident", MLP_RESIDENT_GPU_TARGET if ds_name == "transitions" else None),
            ("step-fed-by-window-copies", None),
        ):
            c = g(fed)
            if c is None or base is None:
                continue
            fed_ratio = res.ratio(
                f"{p} {fed} / step on device batches (1 - input fraction)",
                c, base, target if on_accelerator else None, "step",
            )  # fmt: skip
            if target is not None:
                _gpu_target(res, fed_ratio, target, on_accelerator)
            fraction = 1.0 - c.records_per_s / base.records_per_s
            fractions.setdefault(ds_name, {})[fed] = fraction
            res.notes.append(
                f"{ds_name}: the input pipeline ({fed.removeprefix('step-fed-by-')}) adds "
                f"{fraction:.1%} of the step time ({1e3 * c.median_s / c.batches:.3g} ms/step fed, "
                f"{1e3 * base.median_s / base.batches:.3g} ms/step on device batches)"
            )
        res.notes.append(
            f"{ds_name} GB/s: " + ", ".join(f"{m} {v:.3g}" for m, v in gbps[ds_name].items())
        )
    res.extra["gb_per_s"] = gbps
    res.extra["input_fraction"] = fractions
