"""Kernel benchmarks: one CPU op at a time (paged attention, the projections' GEMMs, SGMV) on the model's shapes."""
