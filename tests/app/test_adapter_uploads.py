"""Bad adapter uploads: each gets a 4xx saying what is wrong, and leaves nothing on disk or in the database.

Also the streaming itself: the files reach the disk while the body arrives, and an upload over the cap is
stopped as soon as the cap is passed, not after the whole body was read.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sqlalchemy import func, select, update

from app.admin.adapters.upload import UploadTooLargeError, staged_upload
from app.db.tables import Adapter, AuditLog, Tenant
from app.keys.service import Scope
from app.web.errors import BadRequestError
from tests.app.gateway_fixtures import gateway_client, make_tenant
from tests.app.test_admin_adapters import adapter_files, adapters_url
from tests.engine.lora_helpers import make_peft_adapter
from tests.engine.tiny_models import make_tiny_model

pytestmark = pytest.mark.anyio

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
Files = list[tuple[str, tuple[str, bytes, str]]]


@pytest.fixture(scope="session")
def foreign_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PEFT adapter for a tiny random Llama (hidden size 64, not the default model's 576)."""
    root = tmp_path_factory.mktemp("foreign")
    tiny = make_tiny_model(root / "tiny")
    return make_peft_adapter(tiny, root / "adapter", seed=3, r=4, target_modules=["q_proj", "v_proj"])


def _replace(files: Files, part: str, content: bytes, name: str | None = None) -> Files:
    return [
        (name or key, (filename, content, media)) if key == part else (key, (filename, data, media))
        for key, (filename, data, media) in files
    ]


def _config_with(folder: Path, **changes: object) -> bytes:
    return json.dumps({**json.loads((folder / CONFIG).read_text()), **changes}).encode()


def _weights_with(folder: Path, tmp: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> bytes:
    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, tmp / "changed.safetensors")
    return (tmp / "changed.safetensors").read_bytes()


def _corrupt_header(data: bytes) -> bytes:
    (header_len,) = struct.unpack("<Q", data[:8])
    return data[:8] + b"\xff" * header_len + data[8 + header_len :]


def _embedding_tensor(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(4, 49152)


def _nan(tensors: dict[str, torch.Tensor]) -> None:
    tensors[f"{Q0}.lora_B.weight"][0, 0] = float("nan")


# (case id, how to spoil the good form, settings changes, status, words the message must hold)
BAD_UPLOADS = [
    ("other-base-model", "foreign", {}, 422, "made for another base model"),
    ("rank-above-ceiling", "good", {"max_adapter_rank": 2}, 400, "ceiling of 2"),
    ("pickled-bin-part", "bin", {}, 400, "'adapter_model.bin'"),
    ("corrupt-header", "corrupt", {}, 422, "corrupt or truncated"),
    ("truncated-weights", "truncated", {}, 422, "corrupt or truncated"),
    ("name-dotdot", "name:../evil", {}, 400, "Invalid adapter name '../evil'"),
    ("name-slash", "name:a/b", {}, 400, "Invalid adapter name 'a/b'"),
    ("name-double-dot-inside", "name:a..b", {}, 400, "no '..'"),
    ("name-too-long", "name:" + "x" * 65, {}, 400, "1 to 64"),
    ("name-of-base-model", "name:@base", {}, 400, "the base model's"),
    ("traversal-part-name", "part:../../x", {}, 400, "Unexpected form part '../../x'"),
    ("oversized", "good", {"max_adapter_bytes": 64 * 1024}, 413, "larger than the limit of 65536 bytes"),
    ("lm-head-target", "lm_head", {}, 422, "lm_head"),
    ("embedding-tensor", "embedding", {}, 422, "embed_tokens"),
    ("nan-weights", "nan", {}, 422, "NaN"),
    ("missing-config", "no-config", {}, 400, "no `adapter_config.json` file part"),
    ("malformed-json-config", "bad-json", {}, 422, "not valid JSON"),
    ("duplicate-part", "duplicate", {}, 400, "two `adapter_model.safetensors` parts"),
    ("no-name", "no-name", {}, 400, "no `name` field"),
    ("bad-replace-flag", "replace:maybe", {}, 400, "`replace` must be true or false"),
]


def _bad_form(spoil: str, good: Path, foreign: Path, tmp: Path, base_model: str) -> tuple[dict[str, str], Files]:
    data, files = {"name": "pirate"}, adapter_files(good)
    kind, _, arg = spoil.partition(":")
    if kind == "foreign":
        files = adapter_files(foreign)
    elif kind == "bin":
        files = _replace(files, WEIGHTS, b"\x80\x04pickled", name="adapter_model.bin")
    elif kind == "corrupt":
        files = _replace(files, WEIGHTS, _corrupt_header((good / WEIGHTS).read_bytes()))
    elif kind == "truncated":
        full = (good / WEIGHTS).read_bytes()
        files = _replace(files, WEIGHTS, full[: len(full) // 2])
    elif kind == "name":
        data["name"] = base_model if arg == "@base" else arg
    elif kind == "part":
        files = [*files, (arg, ("x", b"data", "application/octet-stream"))]
    elif kind == "lm_head":
        files = _replace(files, CONFIG, _config_with(good, target_modules=["q_proj", "v_proj", "lm_head"]))
    elif kind == "embedding":
        files = _replace(files, WEIGHTS, _weights_with(good, tmp, _embedding_tensor))
    elif kind == "nan":
        files = _replace(files, WEIGHTS, _weights_with(good, tmp, _nan))
    elif kind == "no-config":
        files = [part for part in files if part[0] != CONFIG]
    elif kind == "bad-json":
        files = _replace(files, CONFIG, b"{'r': 4,")
    elif kind == "duplicate":
        files = [*files, files[1]]
    elif kind == "no-name":
        data = {}
    elif kind == "replace":
        data["replace"] = arg
    return data, files


async def _recorded(gateway) -> tuple[int, int]:
    async with gateway.database.sessions() as session:
        adapters = await session.scalar(select(func.count()).select_from(Adapter))
        audits = await session.scalar(select(func.count()).select_from(AuditLog))
    return adapters, audits


def _store_entries(home: Path) -> list[str]:
    """What the adapter store holds, an empty uploads folder aside."""
    root = home / "adapters"
    if not root.exists():
        return []
    uploads = root / ".uploads"
    assert not uploads.exists() or not any(uploads.iterdir()), "a staging folder was left behind"
    return sorted(p.name for p in root.iterdir() if p != uploads)


@pytest.mark.parametrize(
    ("spoil", "changes", "status", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_UPLOADS],
)
async def test_bad_upload_is_refused_and_leaves_nothing(
    gateway_settings, default_engine, tenant_adapters, foreign_adapter, tmp_path, spoil, changes, status, words
):
    settings = dataclasses.replace(gateway_settings, **changes)
    async with gateway_client(settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        names_before = set(default_engine.engine.engine.adapters.names())
        data, files = _bad_form(spoil, tenant_adapters["alpha"], foreign_adapter, tmp_path, default_engine.model_name)

        response = await client.post(adapters_url(acme.tenant_id), data=data, files=files, headers=admin.headers)

        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert words in error["message"], error["message"]
        assert ".uploads" not in error["message"] and str(settings.home) not in error["message"]
        assert _store_entries(settings.home) == []
        assert await _recorded(gateway) == (0, 0)
        assert set(default_engine.engine.engine.adapters.names()) == names_before


@pytest.mark.parametrize("tenant", ["unknown", "deleted"])
async def test_upload_to_unknown_or_deleted_tenant_is_404(gateway_settings, default_engine, tenant_adapters, tenant):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        tenant_id = uuid.uuid4()
        if tenant == "deleted":
            tenant_id = (await make_tenant(gateway, "gone")).tenant_id
            async with gateway.database.sessions() as session, session.begin():
                await session.execute(update(Tenant).where(Tenant.id == tenant_id).values(status="deleted"))
        response = await client.post(
            adapters_url(tenant_id),
            data={"name": "pirate"},
            files=adapter_files(tenant_adapters["alpha"]),
            headers=admin.headers,
        )
        assert response.status_code == 404 and str(tenant_id) in response.json()["error"]["message"]
        assert (await client.get(adapters_url(tenant_id), headers=admin.headers)).status_code == 404
        assert _store_entries(gateway_settings.home) == []
        assert await _recorded(gateway) == (0, 0)


async def test_body_that_is_not_a_form_is_400(gateway_settings, default_engine):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        as_json = await client.post(adapters_url(acme.tenant_id), json={"name": "x"}, headers=admin.headers)
        assert as_json.status_code == 400 and "multipart/form-data" in as_json.json()["error"]["message"]
        broken = await client.post(
            adapters_url(acme.tenant_id),
            content=b'--b\r\nContent-Disposition: form-data; name="name"\r\n\r\nx',  # never closed
            headers={**admin.headers, "content-type": "multipart/form-data; boundary=b"},
        )
        assert broken.status_code == 400 and "not a valid multipart" in broken.json()["error"]["message"]
        assert _store_entries(gateway_settings.home) == []
        assert await _recorded(gateway) == (0, 0)


async def test_client_filenames_never_become_paths(gateway_settings, default_engine, tenant_adapters):
    async with gateway_client(gateway_settings, default_engine) as (client, gateway):
        admin = await make_tenant(gateway, "admin", scopes=(Scope.ADMIN,))
        acme = await make_tenant(gateway, "acme")
        files = [
            (key, (f"../../../{key}.evil", content, media))
            for key, (_, content, media) in adapter_files(tenant_adapters["alpha"])
        ]
        response = await client.post(
            adapters_url(acme.tenant_id), data={"name": "pirate"}, files=files, headers=admin.headers
        )
        assert response.status_code == 201, response.text
        digest = response.json()["digest"]
        assert _store_entries(gateway_settings.home) == [digest]
        assert sorted(p.name for p in (gateway_settings.home / "adapters" / digest).iterdir()) == [CONFIG, WEIGHTS]
        assert not list(gateway_settings.home.parent.rglob("*.evil"))


# The stream itself, without HTTP ---------------------------------------------------------------------------

BOUNDARY = "loraplex-test-boundary"
CHUNK = 64 * 1024


def _form_head(name: str) -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{WEIGHTS}"; filename="w"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


async def _body(num_file_bytes: int, on_chunk: Callable[[int], None]) -> AsyncIterator[bytes]:
    """A form whose weights part is ``num_file_bytes`` long, in chunks; ``on_chunk(i)`` runs before chunk i."""
    yield _form_head("pirate")
    sent = 0
    index = 0
    while sent < num_file_bytes:
        on_chunk(index)
        size = min(CHUNK, num_file_bytes - sent)
        yield bytes([index % 251]) * size
        sent += size
        index += 1
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


async def test_an_upload_over_the_cap_stops_as_soon_as_it_passes_it(tmp_path):
    cap = 1024**2
    sent: list[int] = []
    body = _body(50 * cap, sent.append)
    with pytest.raises(UploadTooLargeError, match="larger than the limit of 1 MiB"):
        async with staged_upload(body, f"multipart/form-data; boundary={BOUNDARY}", None, tmp_path, cap, str):
            pass
    assert len(sent) <= cap // CHUNK + 2  # stopped at the cap, not after the 50 MiB were read
    assert list(tmp_path.iterdir()) == []  # the staging folder is gone


async def test_files_reach_the_disk_while_the_body_arrives(tmp_path):
    num_bytes = 8 * 1024**2
    sizes_seen: list[int] = []

    def look(index: int) -> None:
        if index and index % 32 == 0:  # every 2 MiB: the staging file already holds most of what was sent
            (folder,) = tmp_path.iterdir()
            sizes_seen.append((folder / WEIGHTS).stat().st_size)

    body = _body(num_bytes, look)
    with pytest.raises(BadRequestError, match=r"no `adapter_config\.json` file part"):
        async with staged_upload(body, f"multipart/form-data; boundary={BOUNDARY}", None, tmp_path, 2 * num_bytes, str):
            pass
    assert sizes_seen and all(size >= (i + 1) * 2 * 1024**2 - 2 * 1024**2 for i, size in enumerate(sizes_seen))
    assert sizes_seen[-1] >= 4 * 1024**2  # of the 6 MiB sent by then; at most one write block is held back
    assert list(tmp_path.iterdir()) == []


async def test_announced_length_over_the_cap_is_refused_before_reading(tmp_path):
    async def never() -> AsyncIterator[bytes]:
        raise AssertionError("the body was read")
        yield b""

    with pytest.raises(UploadTooLargeError):
        async with staged_upload(never(), f"multipart/form-data; boundary={BOUNDARY}", 10**9, tmp_path, 1024**2, str):
            pass
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
