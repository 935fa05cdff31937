"""Suite-wide set-up: 8 fake CPU devices before JAX starts, absl flags for grain workers."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Helper modules that spawned worker processes import by name.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))

import grain_replay  # noqa: F401 - marks absl flags parsed for grain workers
