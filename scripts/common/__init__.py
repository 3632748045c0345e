"""What scripts of several kinds share: percentiles, HTTP and SSE clients, a server in a child process, /proc reads."""
