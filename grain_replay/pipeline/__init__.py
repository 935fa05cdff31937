"""The host loader: batch reads in grain (loader, batches, shuffle, checkpoint state) and the
worker engine both loaders use (workers, worker_main, slots). Never imports jax: device
placement is :mod:`grain_replay.device`.

Submodules are imported lazily: ``loader`` imports grain.
"""
