"""Admin routes for usage (being written; see app/admin/routes.py)."""

USAGE_ROUTES: list = []
