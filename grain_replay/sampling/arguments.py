"""Argument checks and stream construction shared by the mixture and replay loaders."""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from grain_replay.errors import ArgumentTypeError, InvalidArgumentError, InvalidSamplingError
from grain_replay.pipeline.arguments import LoaderArguments
from grain_replay.pipeline.defaults import default_shard_options
from grain_replay.sampling.priority_options import PrioritizedReplay
from grain_replay.sampling.rate.limit import RateLimiter, make_limiter
from grain_replay.sampling.rate.options import is_rate_limited
from grain_replay.sampling.replay import UniformReplay
from grain_replay.sampling.streams import Stream, make_stream

__all__ = ["check_int", "stream_factory"]


def check_int(name: str, value: Any, *, low: int) -> int:
    """``value`` as an int >= ``low`` (numpy integers are fine; bools and floats are not)."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(
            f"{name} must be an int, got the bool {value!r}. Fix: pass {name} as an int."
        )
    try:
        value = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be an int, got {value!r} ({type(value).__name__}). Fix: pass an "
            "int (a Python or numpy integer; int(x) of a whole float)."
        ) from None
    if value < low:
        raise InvalidArgumentError(f"{name} must be >= {low}, got {value}. Fix: {name} >= {low}.")
    return int(value)


def stream_factory(
    source: Any, args: LoaderArguments
) -> tuple[Callable[[int, int], Stream], str, RateLimiter | None]:
    """Validates the arguments once; returns a stream factory, a description and the
    loader's rate limiter (None without a limit), which holds the store's writers from now
    on (:meth:`RateLimiter.hold`) until the first iterator takes its file over.

    The factory takes the loader's ``worker_count`` and ``worker_buffer_size``: its
    workers read up to ``worker_count * worker_buffer_size - 1`` batches ahead of the
    caller (the lag of prioritized replay's updates).

    ``args.drop_remainder`` is not read: every batch of a mixture or replay stream is whole.
    """
    batch_size = check_int("batch_size", args.batch_size, low=1)
    seed = check_int("seed", args.seed, low=0)
    if seed >= 2**64:
        raise InvalidArgumentError(
            f"seed must be in [0, 2**64), got {seed}. Fix: a seed in that range (e.g. "
            "seed % 2**64)."
        )
    num_epochs, sampling = args.num_epochs, args.sampling
    if num_epochs not in (None, 1):
        raise InvalidSamplingError(
            f"num_epochs={num_epochs!r}: a mixture or replay stream is endless (each source "
            "walks its own epochs, or rows are drawn with replacement). Fix: num_epochs=None "
            "and stop after the steps you want."
        )
    if isinstance(sampling, (UniformReplay, PrioritizedReplay)) and not args.shuffle:
        raise InvalidSamplingError(
            f"shuffle={args.shuffle!r} with sampling={type(sampling).__name__}(...): expected "
            "no shuffle= with replay sampling, which draws rows at random with replacement "
            "(there is no epoch order to keep, so shuffle has no meaning and was ignored). "
            "Fix: drop shuffle=; to read a store in order, use sampling='epochs' (the "
            "default) with shuffle=False."
        )
    shard_options = args.shard_options
    if shard_options is None:
        shard_options = default_shard_options()
    shard_index, shard_count = int(shard_options.shard_index), int(shard_options.shard_count)

    def make(workers: int, buffer: int) -> Stream:
        return make_stream(
            source,
            weights=args.weights,
            sampling=sampling,
            batch_size=batch_size,
            seed=seed,
            shuffle=bool(args.shuffle),
            keys=args.keys,
            source_leaf=args.source_leaf,
            shard_index=shard_index,
            shard_count=shard_count,
            lag=max(0, workers * buffer - 1),
            workers=(workers, buffer),
        )

    if isinstance(source, Mapping) and is_rate_limited(sampling):
        raise InvalidSamplingError(
            f"{sampling!r}: min_size and samples_per_insert limit the replay of one store; "
            f"got a mixture of {list(source)}. Fix: replay the online store alone with the "
            "rate limit, or mix without one."
        )
    stream = make(0, 1)  # fail here on bad input, not in iter()
    # Refuses rate limits that cannot make progress (or contradict the store's), before
    # any batch; then holds the writers: a learner counts from the moment it is built.
    limiter = make_limiter(stream)
    if limiter is not None:
        limiter.hold()
    text = f"{stream.kind}({json.dumps(stream.describe())}, {stream.reader!r})"
    return make, text, limiter
