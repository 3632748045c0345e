"""Admin routes for API keys: issue, list, limit, revoke and rotate; the first admin key, made on the machine."""
