"""Rows gathered by DMA on a TPU: one copy a drawn row, many in flight (a Pallas kernel).

XLA's gather of large rows on a TPU v5e is slow: 256 rows of an 84x84x4 uint8 frame (7.2
MB) took ~4.6 ms, ~1.5 GB/s of the chip's 819, whatever the ring's layout (``(n, 7056)``
words, ``(n, 28224)`` bytes, frames as columns; ``benchmarks/probe_device_layouts.py``), 20x
the conv step it fed. A row held as whole ``(8, 128)`` tiles of 32-bit words (the "tiles"
rows of ``device/lines.py``: ``(leaves, n, lines, 128)``, ``lines`` a multiple of 8) is one
contiguous span of HBM, so the gather is one DMA a row and leaf, HBM to HBM, with
:data:`IN_FLIGHT` copies outstanding: the chip's DMA engines, not a gather loop.

Which of the two gathers a ring uses is measured, not assumed: :func:`faster` compiles and
times both on the device the rows live on (a batch of the size asked, the ring's real
buffers) and keeps the DMA only where it wins; it is never tried off a TPU (the kernel is
Mosaic's), nor where it does not compile (the reason is logged). Tests run the kernel in
Pallas's TPU interpreter on CPU (``interpret=``), values and order bit-exact.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["IN_FLIGHT", "faster", "gather_rows", "on_tpu"]

logger = logging.getLogger(__name__)

IN_FLIGHT = 16  # row copies outstanding at once
_TIMED = 5  # timed runs of each gather (their median)


def on_tpu(devices: Any) -> bool:
    """Whether every device is a TPU (the only place the kernel runs)."""
    devices = list(devices)
    return bool(devices) and all(d.platform == "tpu" for d in devices)


def gather_rows(buf: jax.Array, slots: jax.Array, *, interpret: Any = False) -> jax.Array:
    """Traced: rows ``slots`` of ``buf`` ``(leaves, n, lines, 128)``, as ``(leaves, len(slots),
    lines, 128)``: one DMA a row and leaf, :data:`IN_FLIGHT` of them in flight. ``slots``
    (int32) are clipped into ``[0, n)``, as ``jnp.take(..., mode="clip")`` does.

    ``interpret``: Pallas's TPU interpreter (``pltpu.InterpretParams()``), for CPU tests.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    leaves, n = buf.shape[0], buf.shape[1]
    b = slots.shape[0]
    depth = max(1, min(IN_FLIGHT, b * leaves))
    slots = jnp.clip(slots.astype(jnp.int32), 0, n - 1)

    def kernel(slots_ref: Any, buf_ref: Any, out_ref: Any, sems: Any) -> None:
        def copy(c: Any) -> Any:  # copy c: row c // leaves, leaf c % leaves
            i, leaf = c // leaves, c % leaves
            return pltpu.make_async_copy(
                buf_ref.at[leaf, slots_ref[i]], out_ref.at[leaf, i], sems.at[c % depth]
            )

        def start(c: Any, carry: Any) -> Any:
            @pl.when(c >= depth)
            def _() -> None:  # the copy that used this semaphore is done first
                copy(c - depth).wait()

            copy(c).start()
            return carry

        def finish(c: Any, carry: Any) -> Any:
            copy(c).wait()
            return carry

        total = b * leaves
        jax.lax.fori_loop(0, total, start, 0)
        jax.lax.fori_loop(max(0, total - depth), total, finish, 0)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((leaves, b, *buf.shape[2:]), buf.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA((depth,))],
        ),
        interpret=interpret,
    )(slots, buf)


def _median_s(fn: Callable[..., Any], args: tuple[Any, ...]) -> float:
    jax.block_until_ready(fn(*args))  # compiled and warm
    times = []
    for _ in range(_TIMED):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def faster(
    by_xla: Callable[..., Any], by_dma: Callable[..., Any], args: tuple[Any, ...], where: str
) -> bool:
    """Whether ``by_dma(*args)`` runs faster than ``by_xla(*args)`` on the devices ``args``
    live on: False off a TPU, or when the DMA gather fails to compile or run (logged with
    its reason). Both are jitted by the caller, which then calls the one kept: its program
    is compiled once. ``where`` names the ring in the log."""
    if not on_tpu(d for a in jax.tree.leaves(args) for d in a.devices()):
        return False
    try:
        xla = _median_s(by_xla, args)
    except Exception as e:  # the gather every backend has failed: leave it to the caller
        logger.info("%s: timing XLA's row gather failed (%s); not trying the DMA gather", where, e)
        return False
    try:
        dma = _median_s(by_dma, args)
    except Exception as e:  # Mosaic refused the kernel on this chip or jax
        logger.info("%s: the DMA row gather did not run here (%s); using XLA's gather", where, e)
        return False
    logger.info(
        "%s: rows gathered by %s (DMA %.3f ms, XLA's gather %.3f ms a batch)",
        where,
        "DMA" if dma < xla else "XLA's gather",
        dma * 1e3,
        xla * 1e3,
    )
    return dma < xla
