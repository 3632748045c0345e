"""The engine tier on Ray Serve: replicas, their directory, adapter fetching, and the gateway's client."""
