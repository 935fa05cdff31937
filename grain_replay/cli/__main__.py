"""python -m grain_replay.cli: runs grain-replay."""

from __future__ import annotations

import sys

from grain_replay.cli import main

if __name__ == "__main__":  # importing this module (as the layering test does) runs nothing
    sys.exit(main())
