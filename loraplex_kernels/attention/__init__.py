"""Paged attention: decode rows, split long rows, tiled prefill chunks, the torch path, and their per-step metadata."""
