"""Host RSS of the RLDS reader stays flat over a dataset 10x its growth bound (issue 25)."""

from __future__ import annotations

from typing import Any

import pytest
from rlds_fixture import write_rlds
from rlds_memory import dataset_bytes, measure_rss

BATCH = 16
# Two 128x128x3 frames a step, decoded: what one batch holds.
BATCH_MIB = BATCH * 2 * 128 * 128 * 3 / 2**20
# What RSS may grow by while every step is read twice, past the first batches: two
# batches in flight and allocator slack. The dataset is more than 10x this.
GROWTH_BOUND_MIB = 4 + 2 * BATCH_MIB


@pytest.fixture(scope="module")
def big(tmp_path_factory: Any) -> str:
    root = str(tmp_path_factory.mktemp("rlds_big"))
    write_rlds(root, lengths=[50] * 60, shards=4, size=128, cameras=2, images=False)
    assert dataset_bytes(root) > 10 * GROWTH_BOUND_MIB * 2**20
    return root


@pytest.mark.parametrize(
    ("workers", "frame_cache_bytes"),
    [(0, 0), (0, 1 << 30), (2, 0)],  # decoded on every read; frames on disk; workers
)
def test_rss_is_flat_while_reading_a_dataset_ten_times_the_bound(
    big: str, workers: int, frame_cache_bytes: int
) -> None:
    got = measure_rss(
        big,
        batch_size=BATCH,
        epochs=2,
        workers=workers,
        warmup=8,
        frame_cache_bytes=frame_cache_bytes,
    )
    assert got["steps"] == 2 * (3000 // BATCH) * BATCH  # every whole batch of two epochs
    assert got["growth"] < GROWTH_BOUND_MIB, got
    if workers:
        assert len(got["peaks"]) > workers  # the workers were sampled too
