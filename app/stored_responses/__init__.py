"""Stored responses of /v1/responses (``store: true``): kept in PostgreSQL per tenant, swept after the retention."""
