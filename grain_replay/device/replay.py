"""Device-side replay: a store's live rows in a fixed-size device ring, sampled inside jit."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grain_replay.device import replay_draws as draws
from grain_replay.device import replay_refresh, row_dma
from grain_replay.device import replay_tree as tree
from grain_replay.device.lines import Probe, RowLayout
from grain_replay.device.replay_state import (
    DeviceReplayState,
    StateLayout,
    StateView,
    check_state,
    join_ids,
)
from grain_replay.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidPriorityError,
    InvalidSamplingError,
)
from grain_replay.opening import open_source
from grain_replay.sampling import PrioritizedReplay, Sampled, UniformReplay
from grain_replay.sources import PartsDataSource

__all__ = ["DeviceReplay"]

_MAX_SLOTS = 2**31 - 1


class DeviceReplay:
    """A store's live rows in a fixed-size device ring, sampled inside the user's ``jax.jit``.

    ``init()`` allocates the ring (``capacity`` rows of every leaf, priorities, counters)
    on one device and loads the store's newest rows; ``sample`` and
    ``update_priorities`` are pure functions of the state, for use inside ``jax.jit``;
    ``refresh`` (on the host) brings in the rows committed since and drops the rows the
    store evicted, writing into the same device buffers (donated: never reallocated).

    The ring's slots: ``batch.index`` is the *slot* (int32) a row was drawn from, so
    ``update_priorities`` is a scatter; ``row_ids(state, index)`` maps slots to the
    store's row ids on the host. Update priorities before the next ``refresh``: a slot
    refilled by a refresh is another row.

    Args:
      source: a store ``gr.open_source`` opens (or its path): a plain store, a growing
        store written by ``gr.ReplayWriter``, or a bounded many-writer store.
      sampling: ``gr.UniformReplay()`` or ``gr.PrioritizedReplay(alpha=, beta=, eps=)``;
        ``beta`` must be a float (anneal it with ``sample(..., beta=)`` instead of a
        schedule); ``samples_per_insert`` is not supported (no rate limit on the device);
        ``min_size`` is checked by ``init()``.
      capacity: rows the ring holds (fixed at ``init()``). None: the store's capacity:
        the sum of its writers' capacities for a bounded store, the current length for a
        plain store (a growing plain store then keeps its newest ``capacity`` rows).
        Required for a many-writer store whose writers are unbounded.
      max_writers: watermarks kept for a many-writer store (writer ordinals below it).
      device: where the ring lives; default ``jax.devices()[0]``.

    Raises:
      ArgumentTypeError: ``sampling`` is not a replay sampling option.
      InvalidSamplingError: a ``beta`` schedule or ``samples_per_insert``.
      InvalidArgumentError: ``capacity`` not a positive int, below ``min_size``, or
        missing for an unbounded many-writer store.

    Examples:
      >>> replay = gr.DeviceReplay("replay/", sampling=gr.PrioritizedReplay(alpha=0.6))
      >>> state = replay.init()
      >>> @jax.jit
      ... def step(params, state, key):
      ...     batch = replay.sample(state, key, 256)
      ...     params, td = train(params, batch.data, batch.weight)
      ...     return params, replay.update_priorities(state, batch.index, jnp.abs(td))
      >>> state = replay.refresh(state)  # between steps, on the host
    """

    def __init__(
        self,
        source: Any,
        sampling: Any = None,
        *,
        capacity: int | None = None,
        max_writers: int = 256,
        device: jax.Device | None = None,
    ) -> None:
        if isinstance(source, (str, os.PathLike)):
            source = open_source(source)
        self.source = source
        sampling = UniformReplay() if sampling is None else sampling
        if not isinstance(sampling, (UniformReplay, PrioritizedReplay)):
            raise ArgumentTypeError(
                f"DeviceReplay: sampling must be gr.UniformReplay() or "
                f"gr.PrioritizedReplay(...), got {sampling!r}. Fix: pass one of those."
            )
        if isinstance(sampling, PrioritizedReplay) and callable(sampling.beta):
            raise InvalidSamplingError(
                f"DeviceReplay: beta must be a float, got the schedule {sampling.beta!r}. "
                "Fix: pass PrioritizedReplay(beta=<float>) and anneal inside your jit with "
                "replay.sample(state, key, batch_size, beta=schedule(step))."
            )
        if sampling.samples_per_insert is not None:
            raise InvalidSamplingError(
                f"DeviceReplay: samples_per_insert={sampling.samples_per_insert} is not "
                "supported (draws inside jit cannot wait for writers). Fix: drop it, or "
                "pace refresh() yourself; gr.make_data_loader rate-limits host replay."
            )
        self.sampling = sampling
        for name, value in (("capacity", capacity), ("max_writers", max_writers)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_SLOTS
            ):
                raise InvalidArgumentError(
                    f"DeviceReplay: {name} must be a positive int (at most 2**31 - 1), got "
                    f"{value!r}. Fix: pass e.g. {name}=100_000."
                )
        self._capacity_arg = capacity
        self._writers = max_writers
        self._bounded = isinstance(source, PartsDataSource)
        self._device = jax.devices()[0] if device is None else device
        self._layout: RowLayout | None = None
        self._dma = False  # rows held as tiles gathered by DMA (decided at init)
        self.refresh_traces = 0  # ring updates traced (compiled): one per size class

    # -- set-up ---------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"DeviceReplay({self.source!r}, sampling={self.sampling!r})"

    def _where(self) -> str:
        return str(getattr(self.source, "path", repr(self.source)))

    def _default_capacity(self) -> int:
        if not self._bounded:
            return len(self.source)
        caps = [m.capacity for m in self.source.writers]
        if not caps or any(c is None for c in caps):
            raise InvalidArgumentError(
                f"DeviceReplay: {self._where()} is a many-writer store whose writers are "
                "unbounded (or it has none yet): it has no capacity to size the device ring "
                "by. Fix: pass DeviceReplay(..., capacity=<rows the ring holds>)."
            )
        return min(_MAX_SLOTS, sum(caps))

    def _setup(self) -> RowLayout:
        if self._layout is not None:
            return self._layout
        if len(self.source) == 0:
            raise InvalidSamplingError(
                f"DeviceReplay: {self._where()} has no committed rows to put on the device. "
                "Fix: append and flush rows with a gr.ReplayWriter before init()."
            )
        capacity = self._capacity_arg or self._default_capacity()
        if capacity < self.sampling.min_size:
            raise InvalidArgumentError(
                f"DeviceReplay: capacity={capacity} is below min_size="
                f"{self.sampling.min_size}: the ring could never hold enough rows. Fix: "
                "raise capacity or lower min_size."
            )
        probe = Probe(self.source)
        self._layout = RowLayout(probe, capacity)
        prioritized = isinstance(self.sampling, PrioritizedReplay)
        self._at = StateLayout(capacity, self._writers, prioritized)
        self._expected = jax.eval_shape(self._allocate_fn)
        self._allocate = jax.jit(
            self._allocate_fn, out_shardings=jax.sharding.SingleDeviceSharding(self._device)
        )
        self._write = jax.jit(self._write_fn, donate_argnums=0)
        return self._layout

    @property
    def capacity(self) -> int:
        """Rows the ring holds (set up from the store on first use)."""
        return self._setup().capacity

    def state_bytes(self) -> int:
        """Bytes of a state's device arrays (row buffers, bookkeeping)."""
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self._spec()))

    def row_bytes(self) -> int:
        """Bytes of one record on the device (every leaf)."""
        return self._setup().row_bytes()

    def _spec(self) -> Any:
        self._setup()
        return self._expected

    def _allocate_fn(self) -> DeviceReplayState:
        layout = self._layout
        assert layout is not None
        return replay_refresh.allocate(layout, self._at, self._trees)

    def _trees(
        self, priority: jax.Array, live: jax.Array
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Traced: the sum and min trees of a prioritized replay (empty for uniform)."""
        opts = self.sampling
        if not isinstance(opts, PrioritizedReplay):
            return (), ()
        return tree.build(priority, live, opts.alpha, opts.eps)

    def _check_state(self, state: Any, call: str) -> None:
        """Refuses what is not a state of this replay (shapes, dtypes); works on tracers."""
        what = f"capacity {self.capacity}, leaves of {self._where()}"
        check_state(state, self._spec(), f"DeviceReplay.{call}", what)

    # -- the public surface ----------------------------------------------------------

    def init(self) -> DeviceReplayState:
        """Allocates the ring on the device and loads the store's newest rows into it.

        Returns:
          The state: a pytree of ``jax.Array`` (see :class:`DeviceReplayState`).

        Raises:
          InvalidSamplingError: the store has no committed rows, or fewer than ``min_size``.
          InvalidArgumentError: no capacity can be worked out (see the class).
        """
        if hasattr(self.source, "refresh"):
            self.source.refresh()
        self._setup()
        state = self.refresh(self._allocate(), look=False)
        self._dma = self._dma_is_faster(state)
        live = int(self._at.view(state).n_live)
        if live < max(1, self.sampling.min_size):
            raise InvalidSamplingError(
                f"DeviceReplay: {self._where()} has {live} live rows, fewer than min_size="
                f"{self.sampling.min_size}. Fix: write more rows before init(), or lower min_size."
            )
        return state

    def _dma_is_faster(self, state: DeviceReplayState) -> bool:
        """Whether the ring's rows held as tiles (frames) are gathered faster by DMA than by
        XLA's gather on this device, timed on a batch of 256 (device/row_dma.py)."""
        layout = self._setup()
        if not layout.has_tiles or not row_dma.on_tpu([self._device]):
            return False
        drawn = np.random.default_rng(0).integers(0, layout.capacity, 256).astype(np.int32)
        slots = jax.device_put(drawn, self._device)
        return row_dma.faster(
            jax.jit(lambda rows, s: layout.gather(rows, s)),
            jax.jit(lambda rows, s: layout.gather(rows, s, dma=True)),
            (state.rows, slots),
            f"DeviceReplay over {self._where()}",
        )

    def sample(
        self,
        state: DeviceReplayState,
        key: jax.Array,
        batch_size: int,
        *,
        beta: float | jax.Array | None = None,
    ) -> Sampled:
        """Draws ``batch_size`` rows of the ring: pure, for use inside ``jax.jit``.

        Uniform draws pick among the live slots only; prioritized draws pick slot ``i``
        with probability proportional to ``(priority_i + eps) ** alpha`` over the live
        slots (stratified, down the state's sum tree: no pass over the ring), weights
        ``(p_min / p_i) ** beta`` (float32, ``p_min`` the min tree's). A ring with no
        live row (it cannot raise inside jit) gives index -1 and weight 0.

        Args:
          state: the replay's state.
          key: a ``jax.random`` key.
          batch_size: rows to draw (a static Python int > 0).
          beta: overrides the sampling's ``beta`` (may be traced: an annealing schedule).

        Returns:
          ``gr.Sampled(data, index, weight)``: ``data`` the rows' leaves (the host
          loader's dtypes, on the device), ``index`` int32 slots, ``weight`` float32.

        Raises:
          InvalidArgumentError: ``batch_size`` not a positive int, or a foreign state.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise InvalidArgumentError(
                f"DeviceReplay.sample: batch_size must be a positive Python int (static "
                f"inside jit), got {batch_size!r}. Fix: pass e.g. 256."
            )
        self._check_state(state, "sample")
        layout = self._setup()
        opts = self.sampling
        view = self._at.view(state)
        if isinstance(opts, PrioritizedReplay):
            b = float(opts.beta) if beta is None else beta  # type: ignore[arg-type]
            slots, weight = draws.prioritized(key, view.sums, view.mins, batch_size, b)
        else:
            slots, weight = draws.uniform(key, view.live_slots, view.n_live, batch_size)
        leaves = layout.gather(state.rows, jnp.maximum(slots, 0), dma=self._dma)
        data = jax.tree_util.tree_unflatten(layout.probe.treedef, leaves)
        return Sampled(data, slots, weight)  # type: ignore[arg-type]  # jax arrays here

    def update_priorities(
        self, state: DeviceReplayState, index: jax.Array, priorities: jax.Array
    ) -> DeviceReplayState:
        """``state`` with the priorities of slots ``index`` set: pure, for use inside jit.

        Entries that cannot apply are skipped (nothing can raise inside jit): a slot -1
        or out of range, an empty slot, a negative, NaN or infinite priority. A slot
        given twice keeps the last of its priorities (the host sum tree's rule); a
        priority whose mass ``(priority + eps) ** alpha`` overflows float32 is skipped
        (it would make the tree's total infinite). No scatter on a TPU for rings of up to
        262,144 slots (``device/replay_tree.py``: a TPU writes a scatter's entries one at
        a time).

        Args:
          state: the replay's state.
          index: a batch's ``index`` (int32 slots).
          priorities: one per index (e.g. ``abs(td_error)``).

        Returns:
          The new state.

        Raises:
          InvalidPriorityError: ``index`` and ``priorities`` differ in size.
        """
        self._check_state(state, "update_priorities")
        index, priorities = jnp.asarray(index), jnp.asarray(priorities)
        if index.size != priorities.size:
            raise InvalidPriorityError(
                f"DeviceReplay.update_priorities got {index.size} indices but "
                f"{priorities.size} priorities. Fix: pass one priority per index."
            )
        opts = self.sampling
        alpha, eps = (opts.alpha, opts.eps) if isinstance(opts, PrioritizedReplay) else (1.0, 0.0)
        at = self._at
        live = at.view(state).live
        mass = draws.updated_priorities(state.mass, at, live, index, priorities, alpha, eps)
        return state._replace(mass=mass)

    def view(self, state: DeviceReplayState) -> StateView:
        """``state``'s parts by name (a :class:`~grain_replay.device.replay_state.StateView`
        of slices of its arrays: slot ids, liveness, priorities, trees, watermarks,
        counters); traced inside jit. Raises what ``sample`` does for a foreign state."""
        self._check_state(state, "view")
        return self._at.view(state)

    def row_ids(self, state: DeviceReplayState, index: Any) -> np.ndarray:
        """The store row ids (int64) held by slots ``index``; -1 for an empty slot or an
        index outside the ring (a draw of an empty ring: -1). On the host.

        A row id is the row's position for a plain or growing store, and
        ``ordinal << 40 | seq`` (``source.read_ids``) for a many-writer store.
        """
        self._check_state(state, "row_ids")
        parts = self._at.book_parts(np.asarray(jax.device_get(state.book)))
        hi, lo = parts["slot_hi"], parts["slot_lo"]
        index = np.asarray(index, dtype=np.int64)
        held = (index >= 0) & (index < len(hi))
        safe = np.where(held, index, 0)
        return np.where(held, join_ids(np.take(hi, safe), np.take(lo, safe)), -1)

    def refresh(self, state: DeviceReplayState, *, look: bool = True) -> DeviceReplayState:
        """Brings the rows committed since into the ring and drops the evicted ones (host).

        Calls ``source.refresh()``; the slots of rows the store evicted are emptied (never
        drawn again); new rows go to free slots (emptied longest ago first), then over the
        oldest rows (more new rows than the capacity: the newest ``capacity`` are kept).
        One read and one transfer per leaf for all new rows, then one jitted, donated
        update: the state's buffers are reused (``state`` itself is consumed).

        Args:
          state: the replay's state (consumed).
          look: False skips ``source.refresh()`` (the snapshot as it is).

        Returns:
          The new state.

        Raises:
          InvalidArgumentError: a foreign state, or a writer ordinal beyond ``max_writers``.
          InvalidStoreError: a plain store with fewer rows than the state loaded.
        """
        self._check_state(state, "refresh")
        layout = self._setup()
        if look and hasattr(self.source, "refresh"):
            self.source.refresh()
        return replay_refresh.refresh(
            state,
            self.source,
            layout,
            self._at,
            bounded=self._bounded,
            where=self._where(),
            device=self._device,
            write=self._write,
        )

    # -- refresh internals -------------------------------------------------------------

    def _write_fn(
        self, state: DeviceReplayState, chunk: list[jax.Array], targets: jax.Array, book: Any
    ) -> DeviceReplayState:
        self.refresh_traces += 1  # runs when traced: once per size class
        layout = self._layout
        assert layout is not None
        return replay_refresh.write(state, chunk, targets, book, layout, self._at, self._trees)
