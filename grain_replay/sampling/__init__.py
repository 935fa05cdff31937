"""What a batch is made of: mixtures with exact counts, uniform and prioritized replay."""

from __future__ import annotations

from grain_replay.sampling.priority_options import PrioritizedReplay, Sampled
from grain_replay.sampling.replay import UniformReplay

__all__ = ["PrioritizedReplay", "Sampled", "UniformReplay"]
