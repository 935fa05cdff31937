"""Host RSS of the RLDS reader stays flat over a dataset 10x its growth bound (issue 25)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from rlds_fixture import write_rlds
from rlds_memory import dataset_bytes

HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")

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
    # In a process of its own: RSS growth is the allocator's too, and a test process's
    # heap after the tests before it (freed buffers, the malloc thresholds they moved)
    # grew 19 MiB over the same reads (tests/pipeline's worker files, then this, -n 0).
    kw = dict(
        batch_size=BATCH, epochs=2, workers=workers, warmup=8, frame_cache_bytes=frame_cache_bytes
    )
    code = (
        "import json, sys; from rlds_memory import measure_rss; "
        "print(json.dumps(measure_rss(sys.argv[1], **json.loads(sys.argv[2]))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", code, big, json.dumps(kw)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["steps"] == 2 * (3000 // BATCH) * BATCH  # every whole batch of two epochs
    assert got["growth"] < GROWTH_BOUND_MIB, got
    if workers:
        assert len(got["peaks"]) > workers  # the workers were sampled too
