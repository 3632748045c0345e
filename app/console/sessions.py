"""Console sign-ins: a random session id in a cookie, the admin key and the CSRF token kept in this process.

The cookie holds only the session id (HttpOnly, SameSite=Strict, ``SESSION_LIFETIME_S``); the admin key the
admin signed in with stays in memory here and is checked again by the authenticator on every request, so
revoking that key, or disabling its tenant, ends the session within a second. Signing out forgets the
session at once, so a copied cookie stops working too. Sessions live in the process that created them: with
several gateway replicas behind a load balancer, route /console to one of them (or use sticky sessions).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

SESSION_LIFETIME_S = 30 * 60  # short: a forgotten console tab stops being a way in within half an hour
MAX_SESSIONS = 1000  # admins are few; past this the oldest sign-in is forgotten first
TOKEN_BYTES = 32  # 256 bits of randomness for session ids and CSRF tokens


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def tokens_match(expected: str, given: str | None) -> bool:
    """Constant-time comparison of a CSRF token with what a form or header sent."""
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


@dataclass(slots=True)
class ConsoleSession:
    """One signed-in browser: the admin key it signed in with, its CSRF token and a one-time notice."""

    session_id: str
    api_key: str
    csrf_token: str
    expires_at: float  # time.monotonic() after which the session is over
    notices: list[str] = field(default_factory=list)
    """Messages for the next page shown (then dropped): what an action did."""
    new_secrets: list[tuple[str, str]] = field(default_factory=list)
    """(label, plaintext) of keys just created or rotated: shown on the next page, once, then dropped."""

    def take_notices(self) -> list[str]:
        notices, self.notices = self.notices, []
        return notices

    def take_secrets(self) -> list[tuple[str, str]]:
        shown, self.new_secrets = self.new_secrets, []
        return shown


class ConsoleSessions:
    """The signed-in sessions of this process, each forgotten at sign-out or after SESSION_LIFETIME_S."""

    def __init__(self, lifetime_s: float = SESSION_LIFETIME_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.lifetime_s = lifetime_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()

    def start(self, api_key: str) -> ConsoleSession:
        self._drop_expired()
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
        session = ConsoleSession(new_token(), api_key, new_token(), time.monotonic() + self.lifetime_s)
        self._sessions[session.session_id] = session
        return session

    def find(self, session_id: str | None) -> ConsoleSession | None:
        """The live session of this id, or None (unknown, signed out or expired)."""
        if not session_id:
            return None
        session = self._sessions.get(session_id)
        if session is None:
            return None
        if time.monotonic() >= session.expires_at:
            del self._sessions[session_id]
            return None
        return session

    def end(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(session_id, None)

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for session_id in [sid for sid, session in self._sessions.items() if now >= session.expires_at]:
            del self._sessions[session_id]
