"""flashbax Vaults (``flashbax.vault.Vault``, OG-MARL datasets) as sources, through tensorstore."""

from grain_replay.datasets.vault.source import VaultDataSource

__all__ = ["VaultDataSource"]
