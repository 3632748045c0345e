"""Examples of the response bodies, added to the OpenAPI schema's components (Litestar makes none for them)."""

from __future__ import annotations

from typing import Any

from litestar.openapi.spec import OpenAPI

_TENANT = {
    "id": "7b0e5b8e-4f1e-4c1a-9a53-0f6a1c2d3e4f",
    "name": "acme",
    "status": "active",
    "rpm_limit": 600,
    "tpm_limit": 200000,
    "max_concurrent": None,
    "monthly_token_budget": None,
    "fair_share_weight": 1.0,
    "created_at": "2026-11-22T09:30:00Z",
}
_KEY = {
    "id": "0c9f3a52-8d1b-4f4e-b7b8-2e5d6c7a8b9c",
    "tenant_id": _TENANT["id"],
    "name": "backend",
    "prefix": "lpx_k3v9q2xa",
    "scopes": ["inference"],
    "created_at": "2026-11-22T09:31:00Z",
    "expires_at": None,
    "rpm_limit": 60,
    "tpm_limit": None,
    "max_concurrent": None,
    "monthly_token_budget": None,
}
_USAGE = {
    "prompt_tokens": 37,
    "completion_tokens": 12,
    "total_tokens": 49,
    "prompt_tokens_details": {"cached_tokens": 32},
}

RESPONSE_EXAMPLES: dict[str, dict[str, Any]] = {
    "ChatCompletion": {
        "id": "chatcmpl-5d0e022ea4934f7d8dda1749ce11a203",
        "object": "chat.completion",
        "created": 1795319654,
        "model": "french",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "La capitale de France est Paris."},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": _USAGE,
        "system_fingerprint": None,
    },
    "Completion": {
        "id": "cmpl-9a1f0c7e2b5d4e8f9a0b1c2d3e4f5a6b",
        "object": "text_completion",
        "created": 1795319654,
        "model": "SmolLM2-135M-Instruct",
        "choices": [{"index": 0, "text": " red, yellow and blue.", "finish_reason": "stop", "logprobs": None}],
        "usage": _USAGE,
        "system_fingerprint": None,
    },
    "ModelList": {
        "object": "list",
        "data": [
            {"id": "SmolLM2-135M-Instruct", "object": "model", "created": 0, "owned_by": "loraplex", "parent": None},
            {
                "id": "pirate",
                "object": "model",
                "created": 1795319000,
                "owned_by": "acme",
                "parent": "SmolLM2-135M-Instruct",
            },
        ],
    },
    "TenantOut": _TENANT,
    "TenantList": {"data": [_TENANT]},
    "KeyOut": {**_KEY, "revoked_at": None, "last_used_at": "2026-11-22T10:02:00Z"},
    "KeyList": {"data": [{**_KEY, "revoked_at": None, "last_used_at": "2026-11-22T10:02:00Z"}]},
    "KeyCreated": {**_KEY, "key": "lpx_k3v9q2xa_3q0yVw3l9mP1h3VbV8sKJk2R6c0oZ8nTq5uXyWm1aBc"},
    "CallerOut": {
        "key_id": _KEY["id"],
        "tenant_id": _TENANT["id"],
        "tenant_name": _TENANT["name"],
        "scopes": ["tenant-admin"],
        "tenant_scope": _TENANT["id"],
    },
    "ErrorBody": {
        "error": {
            "message": "The model `pirate` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    },
    "DeletedResponse": {"id": "resp_5f0c2a9e4b7d4e1f8a3c6b2d9e0f1a2b", "deleted": True, "object": "response.deleted"},
    "InputItemList": {
        "object": "list",
        "data": [
            {
                "id": "msg_7c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What is the weather in Paris?"}],
            }
        ],
        "first_id": "msg_7c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f",
        "last_id": "msg_7c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f",
        "has_more": False,
    },
}


def add_response_examples(schema: OpenAPI) -> None:
    """Give each response component above its example, unless it already has one."""
    components = schema.components.schemas if schema.components and schema.components.schemas else {}
    for name, example in RESPONSE_EXAMPLES.items():
        component = components.get(name)
        if component is not None and not component.examples:
            component.examples = [example]
