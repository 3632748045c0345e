"""The memory the engine runs in: the page pool, KV blocks and the prefix cache, host memory, the step's copy in."""
