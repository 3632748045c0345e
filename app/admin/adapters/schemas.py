"""Bodies of the admin adapter routes, as msgspec Structs (their field docs and examples feed the OpenAPI schema)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

import msgspec

from app.db.tables import Adapter

EXAMPLE_ADAPTER_ID = "0b3f6c0e-5d0a-4f1e-9a51-6a3b2f4c8d11"
EXAMPLE_TENANT_ID = "6f1d2c3b-8a9e-4b7c-9d10-2e3f4a5b6c7d"


class AdapterOut(msgspec.Struct, kw_only=True):
    """An adapter as the admin API shows it: its record, and whether the engine holds it now."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    name: Annotated[str, msgspec.Meta(description="The `model` the tenant's keys use.", examples=["pirate"])]
    base_model: Annotated[str, msgspec.Meta(description="The base model it was validated against.")]
    rank: Annotated[int, msgspec.Meta(description="Largest LoRA rank over its modules.", examples=[16])]
    alpha: Annotated[float, msgspec.Meta(description="lora_alpha from adapter_config.json.", examples=[32.0])]
    target_modules: Annotated[list[str], msgspec.Meta(examples=[["q_proj", "v_proj"]])]
    digest: Annotated[str, msgspec.Meta(description="sha256 of the config and weights; names the stored folder.")]
    size_bytes: Annotated[int, msgspec.Meta(description="Bytes of the two files together.")]
    status: Annotated[str, msgspec.Meta(description="`ready`, `failed` or `deleted`.", examples=["ready"])]
    created_at: datetime
    loaded: Annotated[bool, msgspec.Meta(description="Registered in the engine now (the next request runs at once).")]
    pinned: Annotated[bool, msgspec.Meta(description="Kept resident in the engine's pool, never evicted.")]
    tool_call_format: Annotated[
        str | None,
        msgspec.Meta(
            description="The format its tool calls are written and read in; null: the server's default format.",
            examples=["pythonic"],
        ),
    ] = None
    chat_template_sha256: Annotated[
        str | None,
        msgspec.Meta(description="sha256 of its own chat template (from the upload); null: it uses the base model's."),
    ] = None

    @classmethod
    def of(cls, row: Adapter, *, loaded: bool, pinned: bool) -> AdapterOut:
        return cls(
            id=row.id,
            tenant_id=row.tenant_id,
            name=row.name,
            base_model=row.base_model,
            rank=row.rank,
            alpha=row.alpha,
            target_modules=list(row.target_modules),
            digest=row.digest,
            size_bytes=row.size_bytes,
            status=row.status,
            created_at=row.created_at,
            loaded=loaded,
            pinned=pinned,
            tool_call_format=row.tool_call_format,
            chat_template_sha256=row.chat_template_sha256,
        )

    def audit_record(self) -> dict[str, Any]:
        """The JSON the audit log keeps of this adapter (before or after a change)."""
        return msgspec.to_builtins(self)


class AdapterList(msgspec.Struct, kw_only=True):
    """A tenant's live adapters, oldest first."""

    data: list[AdapterOut]


class PinRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of POST /admin/adapters/{adapter_id}/pin; an empty body pins."""

    pinned: bool = True


EXAMPLE_ADAPTER = {
    "id": EXAMPLE_ADAPTER_ID,
    "tenant_id": EXAMPLE_TENANT_ID,
    "name": "pirate",
    "base_model": "SmolLM2-135M-Instruct",
    "rank": 16,
    "alpha": 32.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "digest": "9f2c4e1a7b3d5f60" * 4,
    "size_bytes": 3_540_512,
    "status": "ready",
    "created_at": "2026-01-15T09:30:00Z",
    "loaded": True,
    "pinned": False,
    "tool_call_format": None,
    "chat_template_sha256": None,
}
"""What the OpenAPI page shows as an example AdapterOut."""


def example_error(message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """An error body in OpenAI's shape, for the OpenAPI examples."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
