"""The device writer: appends of ``jax.Array`` leaves queued without waiting for their copy
(queue), the writer's and the sync threads (background, sync_thread), device leaves checked and
packed into one copy a group (leaves, pack)."""
