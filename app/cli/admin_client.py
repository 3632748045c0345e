"""A client of a running server's admin API (``/admin``), for the ``loraplex`` management commands.

It speaks plain JSON and returns the server's records as dicts; every failure is an :class:`AdminError`
whose text is one line for the user: the server's own message for a refused request, or what kept the
request from reaching the server.
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8000"
CONNECT_TIMEOUT_S = 5.0  # a server that is up accepts a connection at once; waiting longer only delays the error
READ_TIMEOUT_S = 300.0  # an upload is checked against the base model and loaded before the server answers
UPLOAD_CHUNK_BYTES = 256 * 1024  # small enough for a smooth progress bar, large enough to keep the socket busy
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # the two files of a PEFT LoRA folder
TEMPLATE_FILE, TOKENIZER_CONFIG_FILE = "chat_template.jinja", "tokenizer_config.json"  # an adapter's own template
FILE_CONTENT_TYPES = {
    "adapter_config.json": "application/json",
    "adapter_model.safetensors": "application/octet-stream",
    TEMPLATE_FILE: "text/plain",
    TOKENIZER_CONFIG_FILE: "application/json",
}
MAX_SHOWN_BODY = 200  # characters of a non-JSON error body repeated in the message


class AdminError(Exception):
    """A request the server refused, or one that never reached it; ``str()`` is one line for the user."""


@dataclass(frozen=True, slots=True)
class _Part:
    header: bytes
    path: Path | None = None
    size: int = 0


class MultipartBody:
    """A ``multipart/form-data`` body streamed from files in chunks, its length known before it is sent.

    Iterating it yields the body; ``on_bytes`` is called with the size of each chunk as it is handed to
    the connection (a progress bar's ``update``).
    """

    def __init__(
        self, fields: dict[str, str], files: dict[str, Path], on_bytes: Callable[[int], object] | None = None
    ) -> None:
        self.boundary = secrets.token_hex(16)
        self.on_bytes = on_bytes
        self._parts = [
            _Part(self._header(f'name="{name}"') + value.encode() + b"\r\n") for name, value in fields.items()
        ]
        for name, path in files.items():
            header = self._header(f'name="{name}"; filename="{name}"', FILE_CONTENT_TYPES[name])
            self._parts.append(_Part(header, path, path.stat().st_size))
        self._closing = f"--{self.boundary}--\r\n".encode()
        # a file part ends with the CRLF before the next boundary
        self.length = sum(len(p.header) + p.size + (2 if p.path else 0) for p in self._parts) + len(self._closing)

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary}"

    def __iter__(self) -> Iterator[bytes]:
        for part in self._parts:
            yield self._sent(part.header)
            if part.path is None:
                continue
            with part.path.open("rb") as file:
                num_left = part.size
                while num_left > 0:
                    chunk = file.read(min(UPLOAD_CHUNK_BYTES, num_left))
                    if not chunk:
                        raise AdminError(f"{part.path} got shorter while it was being uploaded; upload it again")
                    num_left -= len(chunk)
                    yield self._sent(chunk)
            yield self._sent(b"\r\n")
        yield self._sent(self._closing)

    def _header(self, disposition: str, content_type: str | None = None) -> bytes:
        lines = [f"--{self.boundary}", f"Content-Disposition: form-data; {disposition}"]
        if content_type is not None:
            lines.append(f"Content-Type: {content_type}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def _sent(self, chunk: bytes) -> bytes:
        if self.on_bytes is not None:
            self.on_bytes(len(chunk))
        return chunk


class AdminClient:
    """The admin API of the server at ``url``, called with ``admin_key`` (an `admin` or `tenant-admin` key)."""

    def __init__(self, url: str, admin_key: str, *, transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    # tenants

    def create_tenant(self, name: str, **fields: float | None) -> dict[str, Any]:
        """A new tenant; limits (and ``fair_share_weight``) left None take the server's defaults."""
        body = {"name": name, **{field: value for field, value in fields.items() if value is not None}}
        return self._json("POST", "/admin/tenants", json=body)

    def list_tenants(self) -> list[dict[str, Any]]:
        return self._json("GET", "/admin/tenants")["data"]

    def get_tenant(self, tenant_id: str) -> dict[str, Any]:
        return self._json("GET", f"/admin/tenants/{tenant_id}")

    def update_tenant(self, tenant_id: str, **fields: Any) -> dict[str, Any]:
        return self._json("PATCH", f"/admin/tenants/{tenant_id}", json=fields)

    def me(self) -> dict[str, Any]:
        """The calling key: its id, tenant and scopes, and ``tenant_scope``, the one tenant it manages (or None)."""
        return self._json("GET", "/admin/me")

    def resolve_tenant(self, tenant: str) -> dict[str, Any]:
        """The tenant whose id, or else whose name, is ``tenant``.

        A tenant admin's key may only name its own tenant (it cannot list the others); the error says which.
        """
        if _is_uuid(tenant):
            return self.get_tenant(tenant)
        caller = self.me()
        if caller["tenant_scope"] is not None:
            if tenant != caller["tenant_name"]:
                raise AdminError(
                    f"this tenant-admin key manages only the tenant {caller['tenant_name']!r}, not {tenant!r}"
                )
            return self.get_tenant(caller["tenant_scope"])
        for record in self.list_tenants():
            if record["name"] == tenant:
                return record
        raise AdminError(f"no tenant is named {tenant!r}; `loraplex tenants list` shows the tenants")

    # keys

    def create_key(
        self, tenant_id: str, name: str, scopes: list[str], expires_at: str | None = None, **limits: int | None
    ) -> dict[str, Any]:
        """A new key; limits left None leave only the tenant's."""
        body: dict[str, Any] = {"name": name, "scopes": scopes}
        if expires_at is not None:
            body["expires_at"] = expires_at
        body |= {field: value for field, value in limits.items() if value is not None}
        return self._json("POST", f"/admin/tenants/{tenant_id}/keys", json=body)

    def update_key(self, key_id: str, **limits: int | None) -> dict[str, Any]:
        """Change the key's limits given (None clears one: only the tenant's applies)."""
        return self._json("PATCH", f"/admin/keys/{_checked_id(key_id, 'key')}", json=limits)

    def list_keys(self, tenant_id: str) -> list[dict[str, Any]]:
        return self._json("GET", f"/admin/tenants/{tenant_id}/keys")["data"]

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/admin/keys/{_checked_id(key_id, 'key')}")

    def rotate_key(self, key_id: str, grace_period_s: int) -> dict[str, Any]:
        path = f"/admin/keys/{_checked_id(key_id, 'key')}/rotate"
        return self._json("POST", path, json={"grace_period_s": grace_period_s})

    # adapters

    def upload_adapter(
        self,
        tenant_id: str,
        name: str,
        folder: Path,
        *,
        replace: bool = False,
        tool_call_format: str | None = None,
        chat_template: Path | None = None,
        on_start: Callable[[int], object] | None = None,
        on_bytes: Callable[[int], object] | None = None,
    ) -> dict[str, Any]:
        """Stream the folder's two files (and its chat template) to the server.

        ``chat_template`` (a .jinja file or a tokenizer_config.json) is sent instead of the folder's own;
        ``on_start`` gets the body's length before it is sent.
        """
        files = {}
        for file_name in ADAPTER_FILES:
            path = folder / file_name
            if not path.is_file():
                raise AdminError(f"{folder} has no {file_name}; an adapter folder holds {' and '.join(ADAPTER_FILES)}")
            files[file_name] = path
        files.update(_template_part(folder, chat_template))
        fields = {"name": name, **({"replace": "true"} if replace else {})}
        if tool_call_format is not None:
            fields["tool_call_format"] = tool_call_format
        body = MultipartBody(fields, files, on_bytes)
        if on_start is not None:
            on_start(body.length)
        headers = {"Content-Type": body.content_type, "Content-Length": str(body.length)}
        return self._json("POST", f"/admin/tenants/{tenant_id}/adapters", content=iter(body), headers=headers)

    def list_adapters(self, tenant_id: str) -> list[dict[str, Any]]:
        return self._json("GET", f"/admin/tenants/{tenant_id}/adapters")["data"]

    def adapter_action(self, adapter_id: str, action: str) -> dict[str, Any]:
        """``load`` or ``unload`` the adapter."""
        return self._json("POST", f"/admin/adapters/{_checked_id(adapter_id, 'adapter')}/{action}")

    def delete_adapter(self, adapter_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/admin/adapters/{_checked_id(adapter_id, 'adapter')}")

    def pin_adapter(self, adapter_id: str, pinned: bool) -> dict[str, Any]:
        return self._json("POST", f"/admin/adapters/{_checked_id(adapter_id, 'adapter')}/pin", json={"pinned": pinned})

    # usage

    def usage(self, **params: str | None) -> bytes:
        """The body of GET /admin/usage (JSON or CSV, as ``format`` asks)."""
        query = {name: value for name, value in params.items() if value is not None}
        return self._send("GET", "/admin/usage", params=query).content

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, path, **kwargs)
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError:
            raise AdminError(f"the server at {self.url} answered {method} {path} with something not JSON") from None

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise AdminError(f"the server at {self.url} did not answer {method} {path} in time") from None
        except httpx.TransportError as error:
            raise AdminError(
                f"cannot reach the server at {self.url}: {_one_line(str(error) or type(error).__name__)}"
            ) from None
        logger.debug("%s %s -> %s", method, path, response.status_code)
        if response.is_success:
            return response
        raise AdminError(_error_message(response))


def _error_message(response: httpx.Response) -> str:
    """The server's own message for a refused request, on one line."""
    try:
        error = response.json()["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = response.text[:MAX_SHOWN_BODY] or response.reason_phrase, None
    if param and param not in message:
        message = f"{message} (field `{param}`)"
    if response.status_code >= 500:
        return f"the server failed ({response.status_code}): {_one_line(message)}"
    return _one_line(message)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _checked_id(text: str, what: str) -> str:
    """An id as it goes into a path; a typo is caught here rather than answered with the server's 404 page."""
    if not _is_uuid(text):
        raise AdminError(f"{text!r} is not a valid {what} id; ids are UUIDs, as listings show them")
    return text


def _template_part(folder: Path, chat_template: Path | None) -> dict[str, Path]:
    """The chat template part: ``chat_template``, else the folder's chat_template.jinja, else its tokenizer_config.json.

    A tokenizer_config.json is sent only when it holds a ``chat_template`` (or cannot be read here: the server
    says what is wrong with it).
    """
    if chat_template is not None:
        if not chat_template.is_file():
            raise AdminError(f"{chat_template} is not a file; a template is a .jinja file or a {TOKENIZER_CONFIG_FILE}")
        part = TOKENIZER_CONFIG_FILE if chat_template.name == TOKENIZER_CONFIG_FILE else TEMPLATE_FILE
        return {part: chat_template}
    if (folder / TEMPLATE_FILE).is_file():
        return {TEMPLATE_FILE: folder / TEMPLATE_FILE}
    config = folder / TOKENIZER_CONFIG_FILE
    if not config.is_file():
        return {}
    try:
        holds_template = "chat_template" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        holds_template = True
    return {TOKENIZER_CONFIG_FILE: config} if holds_template else {}
