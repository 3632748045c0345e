"""What the engine hands back: incremental text, each token's bytes, outputs and their deltas, a request's queue."""
