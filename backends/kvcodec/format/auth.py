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

Encryption (setting ``encrypt_chunks``): the same key is the *master secret* of an AEAD. Each
tenant (a cache salt, named in the chunk header by ``format.keys.tenant_id``; the empty salt is a
tenant too) has its own AES-256-GCM key, ``HKDF-SHA256(master, salt="kvcodec-tenant:" + tenant id,
info="kvcodec-chunk-aead-v1")``: one tenant's key, leaked, opens that tenant's chunks alone, and
never the master. ``seal(tenant, aad, data)`` encrypts with the current master's tenant key
(``nonce(12) | ciphertext | tag(16)``, a random nonce per call); ``unseal(tenant, aad, blob,
master)`` decrypts with the master that signed the chunk (``signer_index``: a previous key
decrypts as it verifies, and never encrypts), raising ``ForeignChunk`` on anything it cannot
open. The ciphers come from ``cryptography`` (OpenSSL), never written here.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError, ForeignChunk

KEY_BYTES = 32
MIN_KEY_BYTES = 16
_TAG_PERSON = b"kvcodec-chunk-v2"
_ID_PERSON = b"kvcodec-key-id"
_AEAD_INFO = b"kvcodec-chunk-aead-v1"
NONCE_BYTES = 12
AEAD_TAG_BYTES = 16
CIPHER = "aes-256-gcm"
_MAX_TENANT_KEYS = 1024  # derived keys kept per process (HKDF is cheap; this only saves the call)


def _checked(secret: bytes) -> bytes:
    secret = bytes(secret)
    if not MIN_KEY_BYTES <= len(secret) <= 64:
        raise ConfigError(f"a chunk key must be {MIN_KEY_BYTES} to 64 bytes, got {len(secret)}")
    return secret


def _tag(secret: bytes, data: bytes) -> str:
    return hashlib.blake2b(data, key=secret, digest_size=32, person=_TAG_PERSON).hexdigest()


CURRENT, PREVIOUS = "current", "previous"


def tenant_key(master: bytes, tenant: str) -> bytes:
    """A tenant's AES-256 key: HKDF-SHA256 of the master secret with the tenant's id as HKDF's salt."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvcodec-tenant:" + tenant.encode(),
                info=_AEAD_INFO).derive(master)


class ChunkAuth:
    """Signs chunk headers with one secret key and verifies them with it or a ``previous`` one, and
    (``encrypt``) seals chunk sections per tenant (keys ``repr`` never shows)."""

    def __init__(self, secret: bytes, previous: Sequence[bytes] = (), encrypt: bool = False) -> None:
        self._secret = _checked(secret)
        self._previous = [p for p in map(_checked, previous) if p != self._secret]
        self.encrypt = bool(encrypt)
        self._aeads: dict = {}
        self._aead_lock = threading.Lock()
        self.key_id = hashlib.blake2b(self._secret, digest_size=4, person=_ID_PERSON).hexdigest()
        self.previous_ids = [hashlib.blake2b(p, digest_size=4, person=_ID_PERSON).hexdigest()
                             for p in self._previous]

    @classmethod
    def random(cls) -> "ChunkAuth":
        """A key of its own (for chunks that never leave one process: the quality harness)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def tag(self, data: bytes) -> str:
        return _tag(self._secret, data)

    def signer_index(self, data: bytes, tag: object) -> int:
        """Which key made ``tag`` over ``data``: 0 the current one, 1.. a previous one, -1 neither."""
        if not isinstance(tag, str):
            return -1
        for i, secret in enumerate([self._secret, *self._previous]):
            if hmac.compare_digest(_tag(secret, data), tag):
                return i
        return -1

    def signer(self, data: bytes, tag: object) -> str:
        """Which key made ``tag`` over ``data``: ``current``, ``previous``, or "" (neither)."""
        return {-1: "", 0: CURRENT}.get(self.signer_index(data, tag), PREVIOUS)

    # -- encryption (format.container seals each section with these) ------------------------------
    def _aead(self, tenant: str, master: int):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        with self._aead_lock:
            aead = self._aeads.get((tenant, master))
            if aead is None:
                secrets_ = [self._secret, *self._previous]
                if not 0 <= master < len(secrets_):
                    raise ForeignChunk("chunk was encrypted with a key this deployment does not hold")
                if len(self._aeads) >= _MAX_TENANT_KEYS:
                    self._aeads.clear()
                aead = self._aeads[(tenant, master)] = AESGCM(tenant_key(secrets_[master], tenant))
            return aead

    def seal(self, tenant: str, aad: bytes, data) -> bytes:
        """``data`` encrypted and authenticated for ``tenant`` with the current key (``aad`` bound)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._aead(tenant, 0).encrypt(nonce, bytes(data), aad)

    def unseal(self, tenant: str, aad: bytes, blob, master: int = 0) -> bytes:
        """What ``seal`` sealed for ``tenant`` under key ``master`` (0 current, 1.. previous);
        ``ForeignChunk`` if it does not open (another tenant, another key, altered)."""
        from cryptography.exceptions import InvalidTag

        blob = memoryview(blob)
        if len(blob) < NONCE_BYTES + AEAD_TAG_BYTES:
            raise ForeignChunk("encrypted chunk section too short")
        try:
            # a memoryview, not a copy: cryptography reads any buffer (a copy cost more than the AES)
            return self._aead(tenant, master).decrypt(bytes(blob[:NONCE_BYTES]), blob[NONCE_BYTES:], aad)
        except InvalidTag:
            raise ForeignChunk("chunk does not decrypt with this tenant's key") from None

    def verify(self, data: bytes, tag: object) -> bool:
        return bool(self.signer(data, tag))

    def __repr__(self) -> str:
        previous = f", previous={self.previous_ids}" if self.previous_ids else ""
        encrypt = ", encrypt=True" if self.encrypt else ""
        return f"ChunkAuth(key_id={self.key_id}{previous}{encrypt})"


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
              previous_file: Optional[os.PathLike] = None, encrypt: bool = False) -> ChunkAuth:
    """This deployment's chunk key: ``KVCODEC_CHUNK_KEY``, else the key file (made on first use);
    with the previous keys of ``KVCODEC_CHUNK_KEY_PREVIOUS``, else of ``previous_file`` (which must
    exist: a previous key is never made); ``encrypt``: chunks it writes are encrypted."""
    env = os.environ if env is None else env
    return ChunkAuth(_current(key_file, env), _previous(env, previous_file), encrypt=encrypt)


def auth_for(settings) -> ChunkAuth:
    """``load_auth`` from ``kvcodec.settings.Settings`` (``key_file``, ``key_file_previous``,
    ``encrypt_chunks``)."""
    return load_auth(settings.key_file, previous_file=getattr(settings, "key_file_previous", None),
                     encrypt=getattr(settings, "encrypt_chunks", False))


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
