"""Profilers: where the engine's and the gateway's time goes (docs/profile.md, docs/ray-serve.md)."""
