"""loraplex's gateway: the HTTP API over the engine, with its tenants, keys, adapters, limits and usage, and the CLI.

docs/architecture.md#layers maps its packages. The top level holds what composes them: the settings, the model
store, the composition root (gateway.py), the record of the running services, the app factory and ``loraplex serve``.
"""
