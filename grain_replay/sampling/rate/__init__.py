"""The learner's side of rate limits: the options checked (options), the waits before a batch
(limit) and the progress it publishes for the writers (publish). The rule both sides apply is
:mod:`grain_replay.store.progress`; the writers' wait is :mod:`grain_replay.writers.rate_wait`."""
