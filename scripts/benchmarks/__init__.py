"""Benchmarks and the helpers only they use, a package per subject: the figures of docs/benchmarks.md."""
