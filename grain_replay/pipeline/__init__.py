"""From a source to sharded ``jax.Array`` batches: batch reads in grain, then device put.

Submodules are imported lazily: ``loader`` imports grain, ``device_put`` imports jax.
"""
