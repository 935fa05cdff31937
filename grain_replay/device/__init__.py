"""Everything that touches an accelerator (the only room that imports jax): sharded device puts
and their prefetch, the checkpointable wrapper, device-resident replay, multi-host helpers.
Runs in the consuming process, never in loader workers."""
