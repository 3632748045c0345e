"""Admin routes for tenants: create, list, read, change, disable and delete, each change audited."""
