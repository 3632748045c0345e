"""The admin API under /admin: tenants, keys, adapters and usage, for keys with the `admin` scope."""
