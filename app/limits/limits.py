"""One level's limits (a tenant's, or one of its keys'), as the authenticator reads them with the key."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits of a tenant or of a key; None is unlimited (for a key: only the tenant's limit applies)."""

    max_requests_per_minute: int | None = None
    max_tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_tokens_per_month: int | None = None

    def __bool__(self) -> bool:
        """True when at least one limit is set, i.e. when there is anything to enforce."""
        return (
            self.max_requests_per_minute is not None
            or self.max_tokens_per_minute is not None
            or self.max_concurrent is not None
            or self.max_tokens_per_month is not None
        )


NO_LIMITS = Limits()
