"""Adapter uploads: receive, validate, store, record and register an adapter; nothing stays behind when one fails.

The form is streamed into a private staging folder (app/admin/adapters/upload.py), validated by the engine, its chat
template and tool-call format checked (app/admin/adapters/chat.py), and only then moved into the local store by
digest, recorded (its files row in ``adapter_files``, the adapter row and the audit row, one transaction) and
registered in the engine, so the owner's keys can use it at once. Any failure leaves nothing behind: the
staging folder always goes, a stored folder this upload created goes, the transaction rolls back, the engine
forgets the adapter.

An upload with ``replace`` marks the tenant's live adapter of the same name deleted and announces it, in the
transaction that records the new one; retiring the old one is the caller's (app/admin/adapters/service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from app.adapters.announcements import Op, announce
from app.adapters.file_rows import save_files
from app.adapters.store import adapter_row, move_into_store, remove_stored, uploads_root
from app.admin.adapters.chat import AdapterChat, adapter_chat
from app.admin.adapters.rows import DELETED, adapter_out, require_tenant
from app.admin.adapters.upload import AdapterUpload, staged_upload
from app.admin.audit import record_change
from app.db.database import Database
from app.db.tables import Adapter
from app.engine_clients.interface import AdapterInfo, EngineClient
from app.keys.authenticator import Principal
from app.settings import Settings
from app.tool_calls.style import base_chat_style
from app.tool_calls.templates import ChatTemplate
from app.web.errors import ApiError, BadRequestError, ConflictError, NotFoundError
from engine.errors import (
    AdapterError,
    AdapterFormatError,
    AdapterMismatchError,
    UnsupportedAdapterError,
)

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_TAKEN_INDEX = "adapters_tenant_name_live"
MAX_CONCURRENT_VALIDATIONS = 2  # validation reads the whole adapter into memory; bound how many at once
MAX_ECHOED_NAME = 80


class AdapterNameTakenError(ConflictError):
    code = "adapter_name_taken"


class InvalidAdapterError(ApiError):
    """The engine refused the adapter's files; the message is the engine's, naming the file, setting or tensor."""

    status = 422
    code = "invalid_adapter"


INVALID_ADAPTER_CODES: dict[type[AdapterError], str] = {
    AdapterFormatError: "invalid_adapter_format",
    UnsupportedAdapterError: "unsupported_adapter",
    AdapterMismatchError: "adapter_base_model_mismatch",
}


class AdapterUploads:
    """Uploads into this replica's store and engine; the store lock is shared with the removals of deleted adapters."""

    def __init__(self, database: Database, engine: EngineClient, settings: Settings, store_lock: asyncio.Lock) -> None:
        self.database = database
        self.engine = engine
        self.settings = settings
        self._store_lock = store_lock  # moving into the store and recording, against removing stored folders
        self._validations = asyncio.Semaphore(MAX_CONCURRENT_VALIDATIONS)
        self._server_tool_template: ChatTemplate | None = None

    @property
    def server_tool_template(self) -> ChatTemplate:
        """The template the server renders requests with tools by (an adapter without its own inherits it)."""
        if self._server_tool_template is None:
            style = base_chat_style(self.settings.chat_template, self.settings.tool_call_format)
            self._server_tool_template = style.tool_template
        return self._server_tool_template

    def check_name(self, name: str) -> None:
        """400 unless ``name`` can be a `model` name: safe as a word, never a path, not the base model's."""
        if not ADAPTER_NAME.fullmatch(name) or ".." in name:
            shown = name[:MAX_ECHOED_NAME]
            raise BadRequestError(
                f"Invalid adapter name {shown!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit, with no '..' (tenants send it as `model`).",
                param="name",
            )
        if name == self.engine.model_name:
            raise BadRequestError(
                f"The name {name!r} is the base model's; choose another name for the adapter.", param="name"
            )

    async def receive(
        self,
        actor: Principal,
        tenant_id: uuid.UUID,
        body: AsyncIterator[bytes],
        content_type: str | None,
        content_length: int | None,
    ) -> tuple[Adapter, Adapter | None]:
        """The new adapter's row, recorded and registered, and the row it replaced (now deleted), if any."""
        async with self.database.sessions() as session:
            await require_tenant(session, tenant_id)
        uploads = uploads_root(self.settings.home)
        limit = self.settings.max_adapter_bytes
        async with staged_upload(body, content_type, content_length, uploads, limit, self.check_name) as upload:
            info = await self._validate(upload.folder)
            server_template = self.server_tool_template
            server_format = self.settings.tool_call_format
            chat = await asyncio.to_thread(adapter_chat, upload, server_template, server_format)  # compiling takes ms
            return await self._store_and_record(actor, tenant_id, upload, info, chat)

    async def _validate(self, folder: Path) -> AdapterInfo:
        async with self._validations:
            try:
                info = await self.engine.validate_adapter(folder)
            except AdapterError as error:
                message = str(error).replace(f"{folder}: ", "").replace(str(folder), "the upload")
                code = next((c for kind, c in INVALID_ADAPTER_CODES.items() if isinstance(error, kind)), None)
                raise InvalidAdapterError(f"The adapter cannot be served: {message}", code=code) from None
        ceiling = self.settings.max_adapter_rank
        if info.rank > ceiling:
            raise BadRequestError(
                f"The adapter has rank {info.rank}, above this server's ceiling of {ceiling} "
                "(LORAPLEX_MAX_ADAPTER_RANK); retrain it with a smaller r.",
                param="adapter_config.json",
                code="adapter_rank_too_high",
            )
        return info

    async def _store_and_record(
        self, actor: Principal, tenant_id: uuid.UUID, upload: AdapterUpload, info: AdapterInfo, chat: AdapterChat
    ) -> tuple[Adapter, Adapter | None]:
        """Move the files into the store, add the row and its audit row, register it; undo all on failure."""
        home = self.settings.home
        async with self._store_lock:
            folder, created = await asyncio.to_thread(move_into_store, upload.folder, home, info.digest)
            engine_name: str | None = None
            try:
                async with self.database.sessions() as session, session.begin():
                    old = await session.scalar(
                        select(Adapter)
                        .where(Adapter.tenant_id == tenant_id, Adapter.name == upload.name, Adapter.status != DELETED)
                        .with_for_update()
                    )
                    if old is not None and not upload.replace:
                        raise _name_taken(upload.name)
                    before = None
                    if old is not None:
                        before = adapter_out(old, self.engine).audit_record()
                        old.status = DELETED
                        old.pinned = False
                        await session.flush()  # before the insert: the live name is unique
                        await announce(session, Op.DELETE, old.id, old.digest)
                    await save_files(session, folder, info.digest)
                    row = adapter_row(tenant_id, upload.name, self.engine.model_name, info, folder)
                    row.tool_call_format = chat.tool_call_format
                    row.chat_template = chat.chat_template
                    row.chat_template_sha256 = chat.chat_template_sha256
                    session.add(row)
                    await session.flush()
                    await session.refresh(row)  # created_at, filled in by the database
                    engine_name = str(row.id)
                    await self.engine.add_adapter(engine_name, folder)
                    action = "adapter.upload" if old is None else "adapter.replace"
                    after = adapter_out(row, self.engine).audit_record()
                    record_change(session, actor, action, "adapter", row.id, before, after)
            except BaseException as error:
                await self._undo_upload(engine_name, created, info.digest)
                if isinstance(error, IntegrityError):
                    raise _integrity_error(error, upload.name, tenant_id) from None
                raise
        return row, old

    async def _undo_upload(self, engine_name: str | None, created: bool, digest: str) -> None:
        if engine_name is not None and self.engine.has_adapter(engine_name):
            with contextlib.suppress(AdapterError):
                await self.engine.remove_adapter(engine_name)
        if created:  # under the store lock, so no other row can have started using this folder
            await asyncio.to_thread(remove_stored, self.settings.home, digest)


def _name_taken(name: str) -> AdapterNameTakenError:
    return AdapterNameTakenError(
        f"The tenant already has an adapter named {name!r}; send replace=true to replace it, or choose another name.",
        param="name",
    )


def _integrity_error(error: IntegrityError, name: str, tenant_id: uuid.UUID) -> ApiError:
    """A concurrent change the row checks could not see: the same name uploaded twice, or the tenant deleted."""
    if NAME_TAKEN_INDEX in str(error.orig):
        return _name_taken(name)
    return NotFoundError(f"The tenant {tenant_id} was deleted during the upload.", param="tenant_id")
