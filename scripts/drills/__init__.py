"""Drills: end-to-end runs of the paths a test cannot hold for long (a Ray cluster started apart, the API fuzzer)."""
