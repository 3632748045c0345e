"""The stored responses of each tenant: save, read, delete, and sweep those past their retention.

Every read and delete is scoped to the caller's tenant, so another tenant's response is exactly as absent as
one that never existed; a response past its ``expires_at`` is absent too, before the sweeper removes it.
Deleting a tenant deletes its responses (app/admin/tenants/service.py); a save holds the tenant's row in share
mode, so a response that finishes while its tenant is being deleted is not stored after the deletion.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, select

from app.db.database import Database
from app.db.tables import StoredResponse, Tenant

logger = logging.getLogger(__name__)

DELETED_TENANT = "deleted"  # tenants.status of a deleted tenant


@dataclass(frozen=True, slots=True)
class Conversation:
    """What a stored response holds: the items it was generated from, and the response as answered."""

    response_id: str
    input_items: list[dict[str, Any]]
    response: dict[str, Any]

    @property
    def output_items(self) -> list[dict[str, Any]]:
        return list(self.response.get("output") or [])


class ResponseStore:
    """Stored responses in ``stored_responses``, each kept ``retention`` from its creation."""

    def __init__(self, database: Database, retention: timedelta) -> None:
        self._database = database
        self.retention = retention

    async def save(
        self,
        tenant_id: uuid.UUID,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        previous_response_id: str | None,
    ) -> bool:
        """Store the response; False when its tenant is deleted (or gone), so nothing is stored."""
        row = StoredResponse(
            id=response["id"],
            tenant_id=tenant_id,
            previous_response_id=previous_response_id,
            input_items=input_items,
            response=response,
            expires_at=datetime.now(UTC) + self.retention,
        )
        tenant_status = select(Tenant.status).where(Tenant.id == tenant_id).with_for_update(read=True)
        async with self._database.sessions() as session, session.begin():
            if await session.scalar(tenant_status) in (None, DELETED_TENANT):
                logger.info("response %s not stored: its tenant %s is deleted", row.id, tenant_id)
                return False
            session.add(row)
        return True

    async def get(self, tenant_id: uuid.UUID, response_id: str) -> Conversation | None:
        """The tenant's live response of that id; None for an unknown, foreign or expired one."""
        query = select(StoredResponse.input_items, StoredResponse.response).where(
            StoredResponse.id == response_id,
            StoredResponse.tenant_id == tenant_id,
            StoredResponse.expires_at > datetime.now(UTC),
        )
        async with self._database.sessions() as session:
            row = (await session.execute(query)).one_or_none()
        return None if row is None else Conversation(response_id, row.input_items, row.response)

    async def delete(self, tenant_id: uuid.UUID, response_id: str) -> bool:
        """Delete the tenant's response of that id; False when there is none (unknown, foreign or expired)."""
        statement = (
            delete(StoredResponse)
            .where(
                StoredResponse.id == response_id,
                StoredResponse.tenant_id == tenant_id,
                StoredResponse.expires_at > datetime.now(UTC),
            )
            .returning(StoredResponse.id)
        )
        async with self._database.sessions() as session, session.begin():
            return (await session.execute(statement)).first() is not None

    async def sweep(self, now: datetime | None = None) -> int:
        """Delete every response past its retention; returns how many."""
        statement = delete(StoredResponse).where(StoredResponse.expires_at <= (now or datetime.now(UTC)))
        async with self._database.sessions() as session, session.begin():
            result = await session.execute(statement)
        return result.rowcount or 0
