"""Every /admin route, for create_app()."""

from app.admin.adapters import ADAPTER_ROUTES
from app.admin.keys import KEY_ROUTES
from app.admin.tenants import TENANT_ROUTES
from app.admin.usage import USAGE_ROUTES

ADMIN_ROUTES = [*TENANT_ROUTES, *KEY_ROUTES, *ADAPTER_ROUTES, *USAGE_ROUTES]
