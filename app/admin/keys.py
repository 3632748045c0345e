"""Admin routes for keys (being written; see app/admin/routes.py)."""

KEY_ROUTES: list = []
