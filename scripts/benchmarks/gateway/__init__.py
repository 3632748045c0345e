"""Gateway benchmarks, over HTTP on the real server: its own cost, hot-loading, load tests, Ray Serve, JSON mode."""
