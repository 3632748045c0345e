"""The API key format and its keyed hash.

A key reads ``lpx_<id>_<secret>``: ``lpx_`` makes it recognisable (to people and to secret scanners),
``<id>`` is 8 random lowercase letters and digits, and ``<secret>`` is ``secrets.token_urlsafe(32)``.
The database keeps ``lpx_<id>`` (the *prefix*, shown in listings and indexed for the lookup) and an
HMAC-SHA256 of the whole key under the server's key secret, so a leaked table cannot be turned back
into keys, nor checked against guesses, without that secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path

from app.web.errors import AuthenticationError

logger = logging.getLogger(__name__)

KEY_TAG = "lpx"  # the start of every key: lets people and secret scanners tell a loraplex key at a glance
KEY_ID_LENGTH = 8  # 36**8 ≈ 2.8e12 ids: prefixes rarely collide, and a collision only costs one extra row
KEY_ID_ALPHABET = string.ascii_lowercase + string.digits  # no case, no punctuation: easy to read out in listings
KEY_SECRET_BYTES = 32  # 256 bits of randomness per key: unguessable, so one fast hash suffices (no KDF)
KEY_SECRET_LENGTH = 43  # the length of secrets.token_urlsafe(KEY_SECRET_BYTES): ceil(32 * 4 / 3), unpadded
PREFIX_LENGTH = len(KEY_TAG) + 1 + KEY_ID_LENGTH  # "lpx_" + id
KEY_PATTERN = re.compile(rf"{KEY_TAG}_[a-z0-9]{{{KEY_ID_LENGTH}}}_[A-Za-z0-9_-]{{{KEY_SECRET_LENGTH}}}")

SERVER_SECRET_FILE = "key-secret"  # in the data folder, when LORAPLEX_KEY_SECRET is not set
SERVER_SECRET_BYTES = 32  # the HMAC key's randomness: SHA-256's block-size guidance asks for at least 32 bytes
SERVER_SECRET_FILE_MODE = 0o600  # only the server's user may read the secret that every key hash depends on


class MalformedApiKeyError(AuthenticationError):
    """A string that is not a loraplex API key (wrong tag, length or characters)."""

    def __init__(self) -> None:
        super().__init__(
            f"The API key is malformed: loraplex keys look like {KEY_TAG}_<{KEY_ID_LENGTH} letters or digits>_"
            f"<{KEY_SECRET_LENGTH} characters>. Check that you copied the whole key, with nothing around it."
        )


class KeySecretError(RuntimeError):
    """The server's key secret cannot be read or is unusable."""


@dataclass(frozen=True, slots=True)
class GeneratedKey:
    """A new key: the plaintext to show once, and the prefix to store and list."""

    plaintext: str = field(repr=False)  # kept out of repr so that a logged object never leaks the key
    prefix: str


def generate_api_key() -> GeneratedKey:
    """A fresh random key in the ``lpx_<id>_<secret>`` format."""
    key_id = "".join(secrets.choice(KEY_ID_ALPHABET) for _ in range(KEY_ID_LENGTH))
    prefix = f"{KEY_TAG}_{key_id}"
    return GeneratedKey(plaintext=f"{prefix}_{secrets.token_urlsafe(KEY_SECRET_BYTES)}", prefix=prefix)


def key_prefix(plaintext: str) -> str:
    """The stored, listable prefix ``lpx_<id>`` of a key; MalformedApiKeyError if it is not a loraplex key."""
    if KEY_PATTERN.fullmatch(plaintext) is None:
        raise MalformedApiKeyError()
    return plaintext[:PREFIX_LENGTH]


def hash_api_key(key_secret: bytes, plaintext: str) -> bytes:
    """The keyed hash stored for a key: HMAC-SHA256 of the whole key under the server's key secret."""
    return hmac.new(key_secret, plaintext.encode(), hashlib.sha256).digest()


def load_or_create_key_secret(home: Path, configured: str | None) -> bytes:
    """The server's key secret: `configured` (LORAPLEX_KEY_SECRET) if set, else the one in ``home/key-secret``.

    On first use the file is created (mode 0600) holding 32 random bytes written as hex text; the secret
    is that text, so copying the file's content into LORAPLEX_KEY_SECRET later keeps every key valid.
    Losing or changing the secret invalidates every stored key.
    """
    if configured:
        return configured.encode()
    path = home / SERVER_SECRET_FILE
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    home.mkdir(parents=True, exist_ok=True)
    # Write a temporary file, then hard-link it into place: the link fails if another process won the
    # race, and nobody ever reads a half-written secret.
    temporary = home / f".{SERVER_SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SERVER_SECRET_FILE_MODE)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(SERVER_SECRET_BYTES) + "\n")
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
            logger.info("created the API key secret in %s; back it up: losing it invalidates every key", path)
        except FileExistsError:
            logger.info("another process created %s first; using its secret", path)
    finally:
        temporary.unlink(missing_ok=True)
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    secret = path.read_text().strip()
    if not secret:
        raise KeySecretError(
            f"{path} is empty. Restore it from a backup (every API key depends on it), or delete it to create "
            "a new secret and then issue new keys to every tenant."
        )
    if path.stat().st_mode & 0o077:
        logger.warning("%s is readable by other users; run `chmod 600 %s`", path, path)
    return secret.encode()
