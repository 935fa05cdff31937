"""torchrl replay buffer dumps (``ReplayBuffer.dumps``, ``LazyMemmapStorage``) as sources."""

from grain_replay.datasets.torchrl.source import TorchRLDataSource

__all__ = ["TorchRLDataSource"]
