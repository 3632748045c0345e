"""Admin routes for adapters (being written; see app/admin/routes.py)."""

ADAPTER_ROUTES: list = []
