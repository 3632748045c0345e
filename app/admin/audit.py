"""The audit log: one row per admin change, with who made it and the record before and after."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from app.db.tables import AuditLog
from app.keys.authenticator import Principal

logger = logging.getLogger(__name__)


def record_change(
    session: AsyncSession,
    actor: Principal | None,
    action: str,
    target_type: str,
    target_id: uuid.UUID | str | None,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    """Add the audit row to ``session``; it commits with the change it describes, or not at all.

    The row names the actor's key and its tenant (a platform admin's is the `admin` tenant, a tenant admin's
    its own); ``actor`` None is a change made from the machine itself (``loraplex admin create-key``, first start).
    ``before`` and ``after`` must be JSON-serialisable and never hold a secret.
    """
    session.add(
        AuditLog(
            actor_key_id=None if actor is None else actor.key_id,
            actor_tenant_id=None if actor is None else actor.tenant_id,
            action=action,
            target_type=target_type,
            target_id=None if target_id is None else str(target_id),
            before=before,
            after=after,
        )
    )
    by = "this machine" if actor is None else f"key {actor.key_id} of tenant {actor.tenant_name} ({actor.tenant_id})"
    logger.info("audit: %s %s %s by %s", action, target_type, target_id, by)
