"""Benchmarks (``bench_*``, ``load_test``) and the helpers only they use: the figures of docs/benchmarks.md."""
