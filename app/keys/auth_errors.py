"""The errors a Bearer key can get, each saying what was wrong and what to do, and how a key is read from its header.

None of them echoes a secret: a wrong key is shown as its prefix and last characters, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from app.keys.secrets import KEY_TAG
from app.web.errors import AuthenticationError, PermissionDeniedError

MAX_ECHOED_SCHEME_CHARS = 20  # a longer "scheme" is more likely a pasted secret than a scheme name


class MissingApiKeyError(AuthenticationError):
    """The request carries no Authorization header, or one with no key in it."""

    def __init__(self) -> None:
        super().__init__(
            "You didn't provide an API key. You need to provide your API key in an Authorization header using "
            f"Bearer auth (i.e. Authorization: Bearer YOUR_KEY). loraplex keys start with `{KEY_TAG}_`."
        )


class MalformedAuthorizationError(AuthenticationError):
    """The Authorization header uses a scheme other than Bearer."""

    def __init__(self, scheme: str) -> None:
        if scheme.startswith(f"{KEY_TAG}_"):  # the bare key: say so without echoing any of it
            problem = "holds the key without the Bearer scheme"
        elif scheme.isalpha() and len(scheme) <= MAX_ECHOED_SCHEME_CHARS:
            problem = f"uses the `{scheme}` scheme"
        else:
            problem = "does not start with `Bearer `"
        super().__init__(f"The Authorization header {problem}; send `Authorization: Bearer YOUR_KEY`.")


class IncorrectApiKeyError(AuthenticationError):
    """A well-formed key that matches no stored key."""

    def __init__(self, masked_key: str) -> None:
        super().__init__(
            f"Incorrect API key provided: {masked_key}. Check that you copied the whole key, or ask your "
            "administrator for a new one."
        )


class RevokedApiKeyError(AuthenticationError):
    """The key was revoked by an administrator."""

    def __init__(self, prefix: str, revoked_at: datetime) -> None:
        super().__init__(
            f"The API key {prefix} was revoked at {_utc(revoked_at)}; ask your administrator for a new key."
        )


class ExpiredApiKeyError(AuthenticationError):
    """The key's expiry time has passed."""

    def __init__(self, prefix: str, expires_at: datetime) -> None:
        super().__init__(f"The API key {prefix} expired at {_utc(expires_at)}; ask your administrator for a new key.")


class TenantDisabledError(PermissionDeniedError):
    """The key is valid but its tenant is disabled."""

    def __init__(self, tenant_name: str) -> None:
        super().__init__(
            f"The tenant `{tenant_name}` is disabled, so its API keys cannot be used; ask your administrator to "
            "enable it again."
        )


class MissingScopeError(PermissionDeniedError):
    """The key is valid but has none of the scopes the endpoint takes."""

    def __init__(self, prefix: str, scopes: Sequence[str]) -> None:
        wanted = " or ".join(f"`{scope}`" for scope in scopes)
        super().__init__(
            f"The API key {prefix} lacks the {wanted} scope that this endpoint needs; use a key created with "
            f"{'that scope' if len(scopes) == 1 else 'one of them'}."
        )


class ScopeNotValidInTenantError(PermissionDeniedError):
    """The key holds the scope the endpoint takes, but its tenant's keys cannot hold that scope."""

    def __init__(self, prefix: str, refusal: str) -> None:
        super().__init__(f"The API key {prefix} cannot be used here. {refusal}")


def bearer_token(authorization: str | None) -> str:
    """The key from an Authorization header's value; raises when there is none or the scheme is not Bearer."""
    if authorization is None or not authorization.strip():
        raise MissingApiKeyError()
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise MalformedAuthorizationError(scheme)
    token = token.strip()
    if not token:
        raise MissingApiKeyError()
    return token


def _utc(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
