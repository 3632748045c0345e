"""The ``loraplex`` command: the model, the database and the server on this machine, ``doctor``, and the
management commands (tenants, keys, adapters, usage) through a running server's admin API.
"""
