"""Chunk authentication: only chunks written with this deployment's key are ever used.

Anyone who can write to a shared store (or sit between the store and a server) could otherwise put
the KV of another text under a prompt's key, with valid checksums: KV poisoning. So every chunk
carries a keyed tag: BLAKE2b-256 keyed with a secret (RFC 7693's keyed mode, a MAC), over the
chunk's header, which holds the digest of every section (``format.container``). Ingest and
write-back sign; readers verify, and a tag that does not verify makes the chunk *foreign*: a miss,
never KV. The header also names the key by a short public ``key_id`` (a hash of the key), so a
reader can say which key a foreign chunk was written with.

Where the key comes from (``load_auth``), first match wins:

1. ``KVCODEC_CHUNK_KEY``: the key itself, hex (at least 32 hex digits; 64 are made by default);
2. the key file (setting ``key_file``, ``KVCODEC_KEY_FILE``; default ``<home>/chunk.key``), made on
   first use with 32 random bytes, mode 0600. A key file that others may read is refused.

Several servers share one key by sharing that file (or the variable) through whatever carries
their other secrets; a server with another key reads every chunk as foreign and computes the
prompt itself.

Rotation without a cold start: a *previous* key verifies but never signs
(``KVCODEC_CHUNK_KEY_PREVIOUS``, hex, several comma-separated; else the file of setting
``key_file_previous``, ``KVCODEC_KEY_FILE_PREVIOUS``). A chunk signed with it is used, and the
reader says so (``signer``: ``current`` or ``previous``) so that it can be re-signed with the
current key (``serving.resign``). The steps are in docs/operations.md, "Rotating the chunk key".
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError

KEY_BYTES = 32
MIN_KEY_BYTES = 16
_TAG_PERSON = b"kvcodec-chunk-v2"
_ID_PERSON = b"kvcodec-key-id"


def _checked(secret: bytes) -> bytes:
    secret = bytes(secret)
    if not MIN_KEY_BYTES <= len(secret) <= 64:
        raise ConfigError(f"a chunk key must be {MIN_KEY_BYTES} to 64 bytes, got {len(secret)}")
    return secret


def _tag(secret: bytes, data: bytes) -> str:
    return hashlib.blake2b(data, key=secret, digest_size=32, person=_TAG_PERSON).hexdigest()


CURRENT, PREVIOUS = "current", "previous"


class ChunkAuth:
    """Signs chunk headers with one secret key and verifies them with it or a ``previous`` one
    (keys ``repr`` never shows)."""

    def __init__(self, secret: bytes, previous: Sequence[bytes] = ()) -> None:
        self._secret = _checked(secret)
        self._previous = [p for p in map(_checked, previous) if p != self._secret]
        self.key_id = hashlib.blake2b(self._secret, digest_size=4, person=_ID_PERSON).hexdigest()
        self.previous_ids = [hashlib.blake2b(p, digest_size=4, person=_ID_PERSON).hexdigest()
                             for p in self._previous]

    @classmethod
    def random(cls) -> "ChunkAuth":
        """A key of its own (for chunks that never leave one process: the quality harness)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def tag(self, data: bytes) -> str:
        return _tag(self._secret, data)

    def signer(self, data: bytes, tag: object) -> str:
        """Which key made ``tag`` over ``data``: ``current``, ``previous``, or "" (neither)."""
        if not isinstance(tag, str):
            return ""
        if hmac.compare_digest(self.tag(data), tag):
            return CURRENT
        if any(hmac.compare_digest(_tag(p, data), tag) for p in self._previous):
            return PREVIOUS
        return ""

    def verify(self, data: bytes, tag: object) -> bool:
        return bool(self.signer(data, tag))

    def __repr__(self) -> str:
        previous = f", previous={self.previous_ids}" if self.previous_ids else ""
        return f"ChunkAuth(key_id={self.key_id}{previous})"


def _from_hex(text: str, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"{where}: the chunk key must be hex digits") from None
    if len(secret) < MIN_KEY_BYTES:
        raise ConfigError(f"{where}: the chunk key must be at least {MIN_KEY_BYTES} bytes "
                          f"({2 * MIN_KEY_BYTES} hex digits), got {len(secret)}")
    return secret


def load_auth(key_file: os.PathLike, env: Optional[Mapping[str, str]] = None,
              previous_file: Optional[os.PathLike] = None) -> ChunkAuth:
    """This deployment's chunk key: ``KVCODEC_CHUNK_KEY``, else the key file (made on first use);
    with the previous keys of ``KVCODEC_CHUNK_KEY_PREVIOUS``, else of ``previous_file`` (which must
    exist: a previous key is never made)."""
    env = os.environ if env is None else env
    return ChunkAuth(_current(key_file, env), _previous(env, previous_file))


def auth_for(settings) -> ChunkAuth:
    """``load_auth`` from ``kvcodec.settings.Settings`` (``key_file``, ``key_file_previous``)."""
    return load_auth(settings.key_file, previous_file=getattr(settings, "key_file_previous", None))


def _previous(env: Mapping[str, str], previous_file: Optional[os.PathLike]) -> list:
    if env.get("KVCODEC_CHUNK_KEY_PREVIOUS"):
        return [_from_hex(k, "KVCODEC_CHUNK_KEY_PREVIOUS") for k in env["KVCODEC_CHUNK_KEY_PREVIOUS"].split(",")
                if k.strip()]
    if not previous_file:
        return []
    path = Path(previous_file)
    return [_from_hex(k, str(path)) for k in _read_private(path).replace(",", "\n").split() if k.strip()]


def _read_private(path: Path) -> str:
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"chunk key file {path} is not readable: {exc}") from None
    if mode & 0o077:
        raise ConfigError(f"chunk key file {path} may be read by others (mode {oct(mode & 0o777)}); chmod 600 it")
    return text


def _current(key_file: os.PathLike, env: Mapping[str, str]) -> bytes:
    if env.get("KVCODEC_CHUNK_KEY"):
        return _from_hex(env["KVCODEC_CHUNK_KEY"], "KVCODEC_CHUNK_KEY")
    path = Path(key_file)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first: read theirs
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(KEY_BYTES) + "\n")
    return _from_hex(_read_private(path), str(path))
