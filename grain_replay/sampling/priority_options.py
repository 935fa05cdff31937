"""The options of prioritized replay (:class:`PrioritizedReplay`) and the batches it gives
(:class:`Sampled`); the sampler itself is ``sampling/priority.py``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from grain_replay.errors import InvalidSamplingError
from grain_replay.sampling.rate.options import set_rate_limit
from grain_replay.sampling.replay import check_refresh_every
from grain_replay.store.rate_limit import RateLimit

__all__ = ["PrioritizedReplay", "Sampled"]


class Sampled(NamedTuple):
    """A prioritized batch: ``data`` (the rows), ``index`` (int64 row indices) and ``weight``.

    ``weight`` holds float32 importance-sampling weights, ``(p_min / p_i) ** beta``
    with ``p = (priority + eps) ** alpha`` and ``p_min`` the smallest over this
    process's rows: 1 for the least likely row, below 1 for the others. A
    NamedTuple, so it flows through ``sharded_device_put`` like any pytree.
    """

    data: Any
    index: np.ndarray  # type: ignore[assignment]  # shadows tuple.index, as the contract names it
    weight: np.ndarray


def _check_float(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise InvalidSamplingError(f"PrioritizedReplay: {name} must be a float, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidSamplingError(
            f"PrioritizedReplay: {name} must be in [{low}, {high}], got {value}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class PrioritizedReplay:
    """Proportional prioritized replay over a source or a growing store.

    Row ``i`` is drawn with probability ``p_i / sum(p)``, ``p_i = (priority_i + eps) **
    alpha``; a batch is stratified (one draw in each of ``batch_size`` equal slices
    of the total), as in Schaul et al. New rows get the largest priority given so
    far (1.0 before any update). Batches are :class:`Sampled` tuples; the learner
    gives new priorities with ``update_priorities(index, priorities)`` on the
    iterator it holds.

    The arguments it shares with [`UniformReplay`][grain_replay.sampling.replay.UniformReplay]
    are documented there, once: ``refresh_every`` (batches between looks for newly
    committed rows) and the rate limit (``min_size``, ``samples_per_insert``,
    ``tolerance``, ``timeout``, or all four as ``rate_limit``; see docs/rate_limits.md).

    Args:
      alpha: how much priorities count (0: uniform).
      beta: importance-sampling exponent in ``[0, 1]``, or a callable of the step
        returning it (annealed towards 1).
      eps: added to every priority, so no row is never drawn.

    Examples:
      >>> loader = gr.make_data_loader(src, batch_size=256, num_epochs=None,
      ...                              sampling=gr.PrioritizedReplay(alpha=0.6, beta=0.4))
      >>> it = iter(loader); batch = next(it)
      >>> it.update_priorities(batch.index, td_errors)
    """

    alpha: float = 0.6
    beta: float | Callable[[int], float] = 0.4
    eps: float = 1e-6
    refresh_every: int | None = 16
    min_size: int = 0
    samples_per_insert: float | None = None
    tolerance: float | None = None
    timeout: float | None = None
    rate_limit: RateLimit | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", _check_float("alpha", self.alpha, 0.0, 1e3))
        if not callable(self.beta):
            object.__setattr__(self, "beta", _check_float("beta", self.beta, 0.0, 1.0))
        object.__setattr__(self, "eps", _check_float("eps", self.eps, 0.0, 1e30))
        object.__setattr__(
            self,
            "refresh_every",
            check_refresh_every(self.refresh_every, "PrioritizedReplay"),
        )
        set_rate_limit(self)

    def beta_at(self, step: int) -> float:
        """``beta`` at ``step`` (checked when it comes from a schedule)."""
        if callable(self.beta):
            return _check_float(f"beta({step})", self.beta(step), 0.0, 1.0)
        return self.beta
