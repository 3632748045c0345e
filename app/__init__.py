"""loraplex's gateway: settings, the model store, the CLI and (later) the HTTP server."""
