"""Transitions and n-step returns over a step store, with ``next_obs`` stored or derived."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidArgumentError, InvalidStoreError, UnknownLeafError
from grain_replay.rl._derived import DerivedSource, Spans
from grain_replay.rl.episodes import EpisodeFlags, EpisodeIndex
from grain_replay.sources.access import LeafAccess, subtree, with_entries
from grain_replay.store.layout import LeafSpec

__all__ = ["NStepDataSource", "TransitionDataSource", "NStepOptions"]

_LEAF = {"type": "leaf"}
RETURN_KEY = "n_step_return"
DISCOUNT_KEY = "discount"
NSTEPS_KEY = "n_steps"


@dataclasses.dataclass(frozen=True)
class NStepOptions:
    """How transitions are formed: validated once.

    Attributes:
      n: steps summed into the return (1: one-step transitions).
      gamma: discount per step, in ``[0, 1]``.
      obs_key: the observation leaf or group.
      next_obs_key: top-level name of the bootstrap observation; read from the
        store when it has such a leaf/group, else derived from ``obs_key``.
      reward_key: the reward leaf (n-step returns only).
    """

    n: int = 1
    gamma: float = 0.99
    obs_key: str = "obs"
    next_obs_key: str | None = None
    reward_key: str = "reward"

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n <= 0:
            raise InvalidArgumentError(f"n must be a positive int, got {self.n!r}")
        if not 0.0 <= float(self.gamma) <= 1.0:
            raise InvalidArgumentError(f"gamma must be in [0, 1], got {self.gamma!r}")
        if self.next_obs_key is None:
            object.__setattr__(self, "next_obs_key", "next_" + self.obs_key.replace("/", "_"))
        if not self.next_obs_key or "/" in str(self.next_obs_key):
            raise InvalidArgumentError(
                f"next_obs_key must be a top-level name without '/', got {self.next_obs_key!r}"
            )


def _join(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if rel else prefix


class NStepDataSource(DerivedSource):
    """One record per usable step: the step's leaves plus the n-step bootstrap target.

    For step ``t`` of an episode ending (exclusive) at ``end``, with ``k`` the
    steps summed (at most ``n``, never past the episode):

    * ``n_step_return`` = ``sum_{i<k} gamma**i * reward[t+i]``;
    * ``next_obs`` (named ``next_obs_key``) = the observation to bootstrap
      from, ``k`` steps later;
    * ``discount`` = ``gamma**k``, or 0 when the episode terminated within the
      ``k`` steps (then ``next_obs`` is a placeholder, see below), so the
      target is ``n_step_return + discount * V(next_obs)``;
    * ``n_steps`` = ``k``.

    Where ``next_obs`` comes from:

    * stored: the store has a ``next_obs_key`` leaf/group (D4RL's
      ``next_observations``, Minari): every step is a record and
      ``next_obs`` is ``next_obs_key[t+k-1]``, also after a truncation;
    * derived (the store keeps observations once): ``next_obs`` is
      ``obs[t+k]`` inside the episode. The last step of an episode that was
      truncated or is unfinished has no successor observation in the store, so
      it is not a record and earlier steps' ``k`` stops before it (they
      bootstrap from the episode's last observation). The last step of a
      terminated episode is a record with ``discount`` 0 and ``next_obs`` equal
      to its own observation (a placeholder the target ignores).

    All rows a batch needs are read with one vectorized read per leaf (the
    rewards as a ``(B, n)`` gather).

    Args:
      source: a step source (any grain_replay source, or an object with
        ``spec``, ``__len__`` and ``read_batch``).
      n: steps per return.
      gamma: discount per step.
      keys: leaves (or groups) of the step to include; default all. The next
        observation mirrors the selected observation leaves (all of them when
        none is selected); a stored ``next_obs_key`` is always emitted as the
        bootstrap observation, never as a step leaf.
      obs_key: the observation leaf or group.
      next_obs_key: name of the bootstrap observation; default ``"next_" + obs_key``.
      reward_key: the reward leaf.
      done_key: the leaf flagging each episode's last step (default: found by name,
        see :class:`EpisodeFlags`).
      terminated_key: the leaf flagging terminations (default: found by name).
      truncated_key: the leaf flagging truncations (default: found by name).
      episodes: a prebuilt :class:`EpisodeIndex` of the source's steps.
      cache: read/write the episode index cache file.

    Raises:
      InvalidStoreError: ``obs_key``/``reward_key``/flag leaf missing (the
        message lists the leaves), a stored next observation that does not
        mirror the observation, or an added name already a leaf.
      ValueError: ``n`` not positive or ``gamma`` outside ``[0, 1]``.

    Examples:
      >>> src = gr.NStepDataSource(gr.open_source("replay.h5"), n=3, gamma=0.99)
      >>> b = src.read_batch([0, 1]); target = b["n_step_return"] + b["discount"] * v
    """

    _returns = True

    def __init__(
        self,
        source: Any,
        n: int = 3,
        gamma: float = 0.99,
        keys: Sequence[str] | str | None = None,
        *,
        obs_key: str = "obs",
        next_obs_key: str | None = None,
        reward_key: str = "reward",
        done_key: str | None = None,
        terminated_key: str | None = None,
        truncated_key: str | None = None,
        episodes: EpisodeIndex | None = None,
        cache: bool = True,
    ):
        self.options = NStepOptions(n, gamma, obs_key, next_obs_key, reward_key)
        self._plan(source, keys)
        flags = EpisodeFlags(done_key, terminated_key, truncated_key)
        super().__init__(source, flags=flags, episodes=episodes, cache=cache)

    def _plan(self, source: Any, keys: Sequence[str] | str | None) -> None:
        access = LeafAccess(source)
        o = self.options
        where = access.where
        obs_leaves = access.leaves_under(o.obs_key)
        if not obs_leaves:
            raise UnknownLeafError(
                f"{where}: obs_key={o.obs_key!r} names no leaf or group of the store; the "
                f"leaves are {list(access.spec)}. Fix: pass obs_key= with the observation's key."
            )
        if self._returns and o.reward_key not in access.spec:
            raise UnknownLeafError(
                f"{where}: reward_key={o.reward_key!r} names no leaf of the store; the leaves are "
                f"{list(access.spec)}. Fix: pass reward_key= with the reward's key."
            )
        obs_tree = subtree(access.treedef, o.obs_key)
        rels = tree_lib.leaf_keys(obs_tree)
        next_key = str(o.next_obs_key)
        stored = access.leaves_under(next_key)
        self._stored = bool(stored)
        if stored:
            want = [_join(next_key, r) for r in rels]
            bad = [
                k for k, w in zip(obs_leaves, want)
                if w not in access.spec or access.spec[w] != access.spec[k]
            ]  # fmt: skip
            if sorted(stored) != sorted(want) or bad:
                raise InvalidStoreError(
                    f"{where}: the store's {next_key!r} ({stored}) does not mirror "
                    f"{o.obs_key!r} ({obs_leaves}) leaf for leaf with equal dtype and shape. "
                    "Fix: pass next_obs_key= naming a mirror of the observation, or a name "
                    "that is not in the store to derive it from the next step."
                )
        leaves, treedef = access.select(keys)
        if stored:
            leaves = [k for k in leaves if k not in stored]
            treedef = tree_lib.prune_treedef(treedef, leaves)
        # The next observation mirrors the selected observation leaves (all if none is).
        picked = [r for r, k in zip(rels, obs_leaves) if k in leaves] or rels
        if picked != rels:
            obs_tree = tree_lib.prune_treedef(obs_tree, picked)
            rels = picked
        entries: list[tuple[str, dict[str, Any]]] = [(next_key, obs_tree)]
        spec = dict(access.spec)
        for rel in rels:
            spec[_join(next_key, rel)] = access.spec[_join(o.obs_key, rel)]
        if self._returns:
            rdtype = np.result_type(access.spec[o.reward_key].dtype, np.float32)
            entries += [(RETURN_KEY, _LEAF), (DISCOUNT_KEY, _LEAF), (NSTEPS_KEY, _LEAF)]
            spec[RETURN_KEY] = LeafSpec(np.dtype(rdtype), ())
            spec[DISCOUNT_KEY] = LeafSpec(np.dtype(np.float32), ())
            spec[NSTEPS_KEY] = LeafSpec(np.dtype(np.int32), ())
        treedef = with_entries(treedef, entries, where)
        self._leaves = leaves
        # Output next-obs key -> source leaf read at the bootstrap row.
        src_prefix = next_key if stored else o.obs_key
        self._next = {_join(next_key, r): _join(src_prefix, r) for r in rels}
        self._set_structure(treedef, spec)

    @property
    def episodes(self) -> EpisodeIndex:
        """The episode index of this source's records (record ids, not step ids).

        Equal to :attr:`step_episodes` when every step is a record; in derived
        mode a truncated episode has one record fewer than steps, and an
        episode left with none is dropped.
        """
        index, spans = self._derived()
        keep = spans.count > 0
        open_last = bool(index.open_last and keep.size and keep[-1])
        return EpisodeIndex.from_lengths(spans.count[keep], index.terminated[keep], open_last)

    def _spans(self, index: EpisodeIndex) -> Spans:
        count = index.lengths
        if not self._stored:
            count = count - (~index.terminated).astype(np.int64)
        return Spans(index.starts, count)

    def _options_repr(self) -> str:
        o = self.options
        extra = (
            f"n={o.n}, gamma={o.gamma!r}, reward_key={o.reward_key!r}, " if self._returns else ""
        )
        return (
            f"{extra}obs_key={o.obs_key!r}, next_obs_key={o.next_obs_key!r}, "
            f"keys={self._leaves!r}, episodes={self._given_episodes!r}"
        )

    def _read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        o = self.options
        index, spans = self._derived()
        episode, t = spans.locate(ids)
        end = index.ends[episode]
        term = index.terminated[episode]
        n = o.n if self._returns else 1
        # Steps with an observation to bootstrap from, counting from t.
        avail = end - t if self._stored else np.where(term, end - t, end - 1 - t)
        k = np.minimum(n, avail)
        terminal = term & (t + k == end)
        boot = t + k - 1 if self._stored else np.minimum(t + k, end - 1)
        # Per leaf, the named row arrays it needs, concatenated into one read.
        needs: dict[str, dict[str, np.ndarray]] = {key: {"t": t} for key in self._leaves}
        for src_key in self._next.values():
            needs.setdefault(src_key, {})["boot"] = boot
        if self._returns:
            window = np.minimum(t[:, None] + np.arange(n), end[:, None] - 1)
            needs.setdefault(o.reward_key, {})["window"] = window.reshape(-1)
        got = self._access.take(
            {key: np.concatenate(list(rows.values())) for key, rows in needs.items()}
        )
        b = len(ids)
        parts: dict[str, dict[str, np.ndarray]] = {}
        for key, rows in needs.items():
            cuts = np.cumsum([len(r) for r in rows.values()])[:-1]
            parts[key] = dict(zip(rows, np.split(got[key], cuts)))
        out = {key: parts[key]["t"] for key in self._leaves}
        for out_key, src_key in self._next.items():
            out[out_key] = parts[src_key]["boot"]
        if self._returns:
            rewards = (
                parts[o.reward_key]["window"].reshape(b, n).astype(self._spec[RETURN_KEY].dtype)
            )
            powers = np.power(o.gamma, np.arange(rewards.shape[1]), dtype=np.float64)
            live = np.arange(rewards.shape[1]) < k[:, None]
            out[RETURN_KEY] = (
                (rewards * np.where(live, powers, 0.0))
                .sum(axis=1)
                .astype(self._spec[RETURN_KEY].dtype)
            )
            disc = np.where(terminal, 0.0, np.power(o.gamma, k, dtype=np.float64))
            out[DISCOUNT_KEY] = disc.astype(np.float32)
            out[NSTEPS_KEY] = k.astype(np.int32)
        return out


class TransitionDataSource(NStepDataSource):
    """One-step transitions ``(obs, ..., next_obs)`` from a store that keeps observations once.

    Each record is the step's leaves plus ``next_obs`` (named
    ``next_obs_key``), read from the store if it has that leaf/group, else
    derived as ``obs[t+1]`` within the episode, halving what the store keeps.
    Derived ``next_obs`` at an episode's last step: a terminated episode's last
    step is a record whose ``next_obs`` repeats its own observation (the
    terminal flag in the record says not to bootstrap); a truncated or
    unfinished episode's last step is not a record (its successor observation
    is not in the store). See :class:`NStepDataSource` for n-step returns.

    Args:
      source: a step source (any grain_replay source).
      keys: leaves (or groups) to include; default all.
      obs_key: the observation leaf or group.
      next_obs_key: name of the next observation; default ``"next_" + obs_key``.
      done_key: the leaf flagging each episode's last step (default: found by name).
      terminated_key: the leaf flagging terminations (default: found by name).
      truncated_key: the leaf flagging truncations (default: found by name).
      episodes: a prebuilt :class:`EpisodeIndex` of the source's steps.
      cache: read/write the episode index cache file.

    Raises:
      InvalidStoreError: ``obs_key`` or the flag leaves missing (the message
        lists the leaves), or ``next_obs_key`` already a leaf that does not
        mirror the observation.

    Examples:
      >>> src = gr.TransitionDataSource(gr.open_source("obs_once.h5"), obs_key="obs")
      >>> src[0]["next_obs"]
    """

    _returns = False

    def __init__(
        self,
        source: Any,
        keys: Sequence[str] | str | None = None,
        *,
        obs_key: str = "obs",
        next_obs_key: str | None = None,
        done_key: str | None = None,
        terminated_key: str | None = None,
        truncated_key: str | None = None,
        episodes: EpisodeIndex | None = None,
        cache: bool = True,
    ):
        super().__init__(
            source, 1, 1.0, keys, obs_key=obs_key, next_obs_key=next_obs_key,
            done_key=done_key, terminated_key=terminated_key, truncated_key=truncated_key,
            episodes=episodes, cache=cache,
        )  # fmt: skip
