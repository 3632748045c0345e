"""The tenants a load test drives: each with its own inference key and its own PEFT LoRA adapters.

Adapters are built here for the base model (random A, small random non-zero B, so each one changes the
output and none is a no-op), rank 8 or 16 on every linear projection, all distinct. Every tenant gets the
same adapter names (``style-0``, ``style-1``, ...) holding different weights, so a request can only reach
its own tenant's adapter by that name. Everything is made over the admin REST API, as an operator would.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.cli.admin_client import AdminClient

logger = logging.getLogger("load_tenants")

RANKS = (8, 16)  # adapters alternate between these, so one batch mixes ranks
LORA_ALPHA = 16
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.02  # PEFT starts B at zero (a no-op adapter); small random values make a real, still fluent, delta
ADAPTER_PREFIX = "style"


@dataclass(frozen=True, slots=True)
class LoadTenant:
    """A tenant as the load's clients see it: its key and the models it may call (the base model first)."""

    id: str
    name: str
    api_key: str
    models: tuple[str, ...]


def build_adapters(model: Path, out: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` distinct PEFT LoRA folders for ``model`` under ``out``; the base model is loaded once."""
    if count == 0:
        return []
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    names = [f"adapter-{index}" for index in range(count)]
    configs = [
        LoraConfig(r=RANKS[index % len(RANKS)], lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES)
        for index in range(count)
    ]
    peft_model = get_peft_model(base, configs[0], adapter_name=names[0])
    for name, config in zip(names[1:], configs[1:], strict=True):
        peft_model.add_adapter(name, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, B_STD)
    peft_model.save_pretrained(out)  # adapters not named "default" go to out/<name>
    del peft_model, base
    gc.collect()
    return [out / name for name in names]


def create_tenants(
    admin: AdminClient, adapters: list[Path], num_tenants: int, adapters_per_tenant: int, run_tag: str
) -> list[LoadTenant]:
    """Tenants ``load-<run_tag>-<i>`` without limits, each with an inference key and its share of ``adapters``."""
    records = []
    for index in range(num_tenants):
        tenant = admin.create_tenant(f"load-{run_tag}-{index}")
        key = admin.create_key(tenant["id"], "load-test", ["inference"])
        names = []
        for slot in range(adapters_per_tenant):
            name = f"{ADAPTER_PREFIX}-{slot}"
            admin.upload_adapter(tenant["id"], name, adapters[index * adapters_per_tenant + slot])
            names.append(name)
        records.append((tenant, key["key"], names))
        logger.info("tenant %s: %d adapters", tenant["name"], len(names))
    base = base_model_name(admin.url, records[0][1], {name for _, _, names in records for name in names})
    return [
        LoadTenant(id=tenant["id"], name=tenant["name"], api_key=key, models=(base, *names))
        for tenant, key, names in records
    ]


def base_model_name(url: str, api_key: str, adapter_names: set[str]) -> str:
    """The base model's name in the API: the one model in ``GET /v1/models`` that is none of the adapters."""
    response = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30.0)
    response.raise_for_status()
    bases = [card["id"] for card in response.json()["data"] if card["id"] not in adapter_names]
    if len(bases) != 1:
        raise RuntimeError(f"expected one base model in GET /v1/models besides the adapters, got {bases}")
    return bases[0]


def delete_tenants(url: str, admin_key: str, tenants: list[LoadTenant]) -> None:
    """Delete the load's tenants (their keys are revoked, their adapters deleted) from a server that stays up."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60.0) as http:
        for tenant in tenants:
            response = http.delete(f"/admin/tenants/{tenant.id}")
            if response.status_code != 200:
                logger.warning("deleting tenant %s answered %d", tenant.name, response.status_code)
