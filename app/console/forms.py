"""Form fields to the admin API's request Structs, with the same constraints and errors in words.

A console form posts strings; ``msgspec.convert(..., strict=False)`` turns "600" into 600 and "2.5" into
2.5 and then applies the Struct's own constraints, so a value the REST API refuses is refused here too,
with the field named. An empty field is left out (for a limit: unlimited, or unchanged on an update
form, which sends every limit field, so empty there means "clear it", see :func:`limit_changes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import msgspec

from app.admin.tenants.service import LIMIT_FIELDS

T = TypeVar("T")

MAX_FIELD_CHARS = 4096  # no console field needs more; longer values are refused before any parsing

FIELD_LABELS = {
    "name": "Name",
    "rpm_limit": "Requests a minute",
    "tpm_limit": "Tokens a minute",
    "max_concurrent": "Concurrent requests",
    "monthly_token_budget": "Monthly token budget",
    "fair_share_weight": "Fair-share weight",
    "grace_period_s": "Grace period (seconds)",
    "scopes": "Scopes",
    "status": "Status",
}


class FormError(ValueError):
    """A form value the service would refuse; ``message`` names the field in words."""

    status = 400  # as the REST API answers the same value

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def form_values(form: Mapping[str, Any], names: Iterable[str]) -> dict[str, str]:
    """The named text fields that are present and not blank, stripped; FormError for an oversized one."""
    values: dict[str, str] = {}
    for name in names:
        value = form.get(name)
        if not isinstance(value, str):
            continue
        if len(value) > MAX_FIELD_CHARS:
            raise FormError(f"{FIELD_LABELS.get(name, name)} is too long: at most {MAX_FIELD_CHARS} characters.")
        if value.strip():
            values[name] = value.strip()
    return values


def limit_changes(form: Mapping[str, Any]) -> dict[str, str | None]:
    """An update form's limits: every limit field it sent, blank meaning unlimited (null)."""
    present = {name for name in LIMIT_FIELDS if isinstance(form.get(name), str)}
    values = form_values(form, present)
    return {name: values.get(name) for name in present}


def convert(values: Mapping[str, Any], into: type[T]) -> T:
    """``values`` as the Struct ``into``, or FormError naming the field and what it must be."""
    try:
        return msgspec.convert(dict(values), into, strict=False)
    except msgspec.ValidationError as error:
        raise FormError(_in_words(str(error))) from None


def _in_words(message: str) -> str:
    """msgspec's "Expected `int` >= 0 - at `$.rpm_limit`" as "Requests a minute: expected a whole number >= 0"."""
    detail, _, where = message.partition(" - at `$.")
    field = where.rstrip("`").split(".")[0].split("[")[0]
    detail = (
        detail.replace("Expected `int`", "expected a whole number")
        .replace("Expected `float`", "expected a number")
        .replace("Expected `str`", "expected text")
        .replace("Expected `str` matching regex", "expected text matching")
    )
    if not field:
        return detail[:1].upper() + detail[1:] + "."
    return f"{FIELD_LABELS.get(field, field)}: {detail[:1].lower() + detail[1:]}."
