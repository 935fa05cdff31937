"""Per-leaf statistics for normalization: one streaming pass, mergeable, cached beside the store.

``compute.py`` is the entry point, ``accumulate.py`` the arithmetic (moments,
quantile samples, merges) and ``cache.py`` the cache file and appended rows.
"""

from __future__ import annotations

from grain_replay.stats.accumulate import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_QUANTILES,
    DEFAULT_SAMPLE_ROWS,
    quantile_error,
    quantile_name,
    stats_cache_path,
)
from grain_replay.stats.compute import compute_stats, iter_json

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_QUANTILES",
    "DEFAULT_SAMPLE_ROWS",
    "compute_stats",
    "iter_json",
    "quantile_error",
    "quantile_name",
    "stats_cache_path",
]
