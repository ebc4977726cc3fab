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
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Mapping, Optional

from ..errors import ConfigError

KEY_BYTES = 32
MIN_KEY_BYTES = 16
_TAG_PERSON = b"kvcodec-chunk-v2"
_ID_PERSON = b"kvcodec-key-id"


class ChunkAuth:
    """Signs and verifies chunk headers with one secret key (which ``repr`` never shows)."""

    def __init__(self, secret: bytes) -> None:
        secret = bytes(secret)
        if not MIN_KEY_BYTES <= len(secret) <= 64:
            raise ConfigError(f"a chunk key must be {MIN_KEY_BYTES} to 64 bytes, got {len(secret)}")
        self._secret = secret
        self.key_id = hashlib.blake2b(secret, digest_size=4, person=_ID_PERSON).hexdigest()

    @classmethod
    def random(cls) -> "ChunkAuth":
        """A key of its own (for chunks that never leave one process: the quality harness)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def tag(self, data: bytes) -> str:
        return hashlib.blake2b(data, key=self._secret, digest_size=32, person=_TAG_PERSON).hexdigest()

    def verify(self, data: bytes, tag: object) -> bool:
        return isinstance(tag, str) and hmac.compare_digest(self.tag(data), tag)

    def __repr__(self) -> str:
        return f"ChunkAuth(key_id={self.key_id})"


def _from_hex(text: str, where: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"{where}: the chunk key must be hex digits") from None
    if len(secret) < MIN_KEY_BYTES:
        raise ConfigError(f"{where}: the chunk key must be at least {MIN_KEY_BYTES} bytes "
                          f"({2 * MIN_KEY_BYTES} hex digits), got {len(secret)}")
    return secret


def load_auth(key_file: os.PathLike, env: Optional[Mapping[str, str]] = None) -> ChunkAuth:
    """This deployment's chunk key: ``KVCODEC_CHUNK_KEY``, else the key file (made on first use)."""
    env = os.environ if env is None else env
    if env.get("KVCODEC_CHUNK_KEY"):
        return ChunkAuth(_from_hex(env["KVCODEC_CHUNK_KEY"], "KVCODEC_CHUNK_KEY"))
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
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"chunk key file {path} is not readable: {exc}") from None
    if mode & 0o077:
        raise ConfigError(f"chunk key file {path} may be read by others (mode {oct(mode & 0o777)}); chmod 600 it")
    return ChunkAuth(_from_hex(text, str(path)))
