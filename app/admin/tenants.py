"""Admin routes for tenants (being written; see app/admin/routes.py)."""

TENANT_ROUTES: list = []
