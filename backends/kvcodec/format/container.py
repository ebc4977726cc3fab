"""The chunk container: one stored KV chunk as bytes.

Layout::

    b"KVCC" | u16 format version | u32 header length | header (UTF-8 JSON) | sections...

The header holds the geometry, the codec and layout identity, the model identity, the key, the
quantization side data's place, and for each section its length and BLAKE2b digest. Two fields
cover the header itself:

- ``tag``: the keyed authentication tag of ``format.auth`` over the canonical JSON with both
  fields empty (``key_id`` names the key), so only a writer holding the deployment's key makes
  chunks a reader accepts;
- ``header_digest``: an unkeyed BLAKE2b digest of the canonical JSON with only itself empty (the
  tag included), which tells a damaged header, tag included (corrupt), from a chunk written with
  another key (foreign).

``parse(data, auth)`` checks magic, version, lengths, the header digest (``CorruptChunk``), the
tag (``ForeignChunk``: another key, or altered by someone without it) and every section's digest
(``CorruptChunk``): a container that parses is exactly what a holder of the key wrote. Format
version 1 (no tag) is foreign to this build.

Encrypted chunks (``to_bytes`` with ``auth.encrypt``, or ``encrypt=True``): the header says
``cipher: aes-256-gcm`` and names the tenant (``tenant``: ``format.keys.tenant_id`` of the cache
salt, "" unsalted); every section is sealed with the tenant's key (``format.auth``), bound to the
header (the canonical header without its section table and cover fields, plus the section's name,
is the AEAD's associated data), and the header fields that would tell something of the KV
(``SEALED_FIELDS``: the digest of the decoded planes, which would let anyone holding a guess of a
prompt confirm it) move into a sealed section of their own. Section digests are then over the
ciphertext; ``parse`` does not recompute them (AES-GCM authenticates each section as it opens,
at a tenth of a digest's cost). ``parse`` decrypts with the key that signed the chunk and gives back
the plaintext sections, their digests (taken when asked for) and the sealed fields, as if the chunk
had been stored in the clear (``Container.encrypted`` says it was not); a chunk under another
master key is ``ForeignChunk`` (its tag), a section that does not open under the right one was
altered: ``CorruptChunk``.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any, Dict

from ..errors import CorruptChunk, ForeignChunk
from .auth import CIPHER, CURRENT, PREVIOUS, ChunkAuth

MAGIC = b"KVCC"
FORMAT_VERSION = 2
_COVER = ("tag", "header_digest")  # the fields that cover the header, empty while it is hashed
_PREFIX = struct.Struct("<4sHI")
_MAX_HEADER = 1 << 20
SEALED = "sealed"  # the section holding the sealed header fields of an encrypted chunk
SEALED_FIELDS = ("planes_digest",)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def planes_digest(planes) -> str:
    """The header's ``planes_digest``: BLAKE2b-128 of the decoded planes' samples (a numpy array),
    hashed straight from the array's buffer (no copy)."""
    import numpy as np

    return hashlib.blake2b(memoryview(np.ascontiguousarray(planes)).cast("B"), digest_size=16).hexdigest()


def _canonical(header: Dict[str, Any], *empty: str) -> bytes:
    return json.dumps(dict(header, **{k: "" for k in empty}), sort_keys=True).encode()


def _aad(header: Dict[str, Any], name: str) -> bytes:
    """A sealed section's associated data: the header as a reader sees it, and the section's name."""
    return _canonical(header) + b"|section:" + name.encode()


@dataclass
class Container:
    """A parsed chunk: its header fields and named byte sections."""

    header: Dict[str, Any]
    sections: Dict[str, bytes] = field(default_factory=dict)
    digests: Dict[str, str] = field(default_factory=dict)  # per section, as verified by ``parse``
    signer: str = "current"  # the key whose tag ``parse`` verified: current or previous (``format.auth``)
    encrypted: bool = False  # it was stored encrypted (``parse``)

    def to_bytes(self, auth: ChunkAuth, encrypt: bool | None = None) -> bytes:
        """The container's bytes, signed with ``auth``; encrypted for its ``tenant`` when ``encrypt``
        (None: as ``auth.encrypt`` says)."""
        header = dict(self.header)
        header.pop("cipher", None)
        sections = dict(self.sections)
        if auth.encrypt if encrypt is None else encrypt:
            sealed = {k: header.pop(k) for k in SEALED_FIELDS if k in header}
            header["cipher"] = CIPHER
            header.setdefault("tenant", "")
            if sealed:
                sections[SEALED] = json.dumps(sealed, sort_keys=True).encode()
            tenant = str(header["tenant"])
            sections = {name: auth.seal(tenant, _aad(header, name), data) for name, data in sections.items()}
        header["sections"] = [
            {"name": name, "length": len(data), "digest": _digest(data)} for name, data in sections.items()
        ]
        header["key_id"] = auth.key_id
        header["tag"] = auth.tag(_canonical(header, *_COVER))
        header["header_digest"] = _digest(_canonical(header, "header_digest"))
        blob = json.dumps(header, sort_keys=True).encode()
        parts = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob)), blob]
        parts.extend(sections.values())
        return b"".join(parts)

    def without(self, *names: str) -> "Container":
        """A copy without the named sections (e.g. the bitstream, once decoded)."""
        return Container(dict(self.header), {k: v for k, v in self.sections.items() if k not in names},
                         {k: v for k, v in self.digests.items() if k not in names}, self.signer, self.encrypted)

    def expect(self, **fields: Any) -> None:
        """Raise ``ForeignChunk`` unless each header field has the expected value."""
        for name, want in fields.items():
            got = self.header.get(name)
            if got != want:
                raise ForeignChunk(f"chunk {name} is {got!r}, expected {want!r}")


def parse(data, auth: ChunkAuth) -> Container:
    """Parse and verify a container: ``CorruptChunk`` on anything damaged, ``ForeignChunk`` on a
    chunk ``auth`` did not sign (or another format version).

    ``data`` is any buffer (bytes, a numpy array...). Sections are zero-copy ``memoryview``s of it,
    valid while ``data`` is: the caller keeps it alive, or copies what it keeps.
    """
    try:
        data = memoryview(data).cast("B")
    except TypeError:
        raise CorruptChunk("chunk is not a byte buffer") from None
    if len(data) < _PREFIX.size:
        raise CorruptChunk(f"chunk too short ({len(data)} bytes)")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptChunk("not a kvcodec chunk (bad magic)")
    if version != FORMAT_VERSION:
        raise ForeignChunk(f"chunk format version {version}, this build reads {FORMAT_VERSION}")
    if header_len > _MAX_HEADER or _PREFIX.size + header_len > len(data):
        raise CorruptChunk("chunk header length out of range")
    try:
        header = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + header_len]))
        sections_meta = header["sections"]
        stored_digest = header["header_digest"]
        if not isinstance(header, dict) or not isinstance(sections_meta, list):
            raise TypeError("header or section table is not what the format says")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptChunk(f"chunk header unreadable: {exc}") from None
    if _digest(_canonical(header, "header_digest")) != stored_digest:
        raise CorruptChunk("chunk header checksum mismatch")
    master = auth.signer_index(_canonical(header, *_COVER), header.get("tag"))
    if master < 0:
        raise ForeignChunk(f"chunk is not signed with this deployment's key (written with key "
                           f"{str(header.get('key_id'))[:16]!r}, this key is {auth.key_id!r})")
    offset = _PREFIX.size + header_len
    sealed = "cipher" in header
    sections: Dict[str, memoryview] = {}
    digests: Dict[str, str] = {}
    for meta in sections_meta:
        try:
            name, length, digest = meta["name"], int(meta["length"]), meta["digest"]
        except (KeyError, TypeError, ValueError):
            raise CorruptChunk(f"bad section entry in chunk header: {meta!r}"[:200]) from None
        if length < 0:
            raise CorruptChunk(f"chunk section {name!r} has a negative length")
        end = offset + length
        if end > len(data):
            raise CorruptChunk(f"chunk section {meta['name']!r} truncated")
        body = data[offset:end]
        # an encrypted section is authenticated by AES-GCM as it opens, below: its digest (still
        # written, for readers of the clear format) would hash the same bytes twice
        if not sealed and _digest(body) != digest:
            raise CorruptChunk(f"chunk section {name!r} checksum mismatch")
        sections[name] = body
        digests[name] = digest
        offset = end
    if offset != len(data):
        raise CorruptChunk(f"{len(data) - offset} trailing bytes after the last section")
    header = {k: v for k, v in header.items() if k not in ("sections", "key_id") + _COVER}
    signer = CURRENT if master == 0 else PREVIOUS
    if "cipher" not in header:
        return Container(header, sections, digests, signer)
    if header["cipher"] != CIPHER:
        raise ForeignChunk(f"chunk cipher {str(header['cipher'])[:32]!r} is not one this build reads")
    tenant = str(header.get("tenant", ""))
    try:
        plain = {name: auth.unseal(tenant, _aad(header, name), body, master) for name, body in sections.items()}
    except ForeignChunk as exc:
        # the header's tag verified under this master key, so this tenant's key is the right one:
        # a section that does not open was altered after it was written
        raise CorruptChunk(f"encrypted chunk section altered ({exc})") from None
    sealed = plain.pop(SEALED, None)
    if sealed is not None:
        try:
            fields = json.loads(sealed)
        except ValueError:
            raise CorruptChunk("sealed header fields unreadable") from None
        header.update({k: v for k, v in fields.items() if k in SEALED_FIELDS} if isinstance(fields, dict) else {})
    return Container(header, plain, _Digests(plain), signer, encrypted=True)


class _Digests(dict):
    """The plaintext sections' digests, each taken when first asked for: AES-GCM has already
    authenticated them; a reader asks only for the one a verbatim coder compares (``serving.decode``)."""

    def __init__(self, sections: Dict[str, bytes]) -> None:
        super().__init__()
        self._sections = sections

    def __missing__(self, name: str) -> str:
        if name not in self._sections:
            raise KeyError(name)
        self[name] = digest = _digest(self._sections[name])
        return digest

    def get(self, name, default=None):
        return self[name] if name in self._sections else default

    def items(self):
        return [(name, self[name]) for name in self._sections]


def resign(data, auth: ChunkAuth) -> bytes:
    """A chunk ``auth`` verifies (with its current or a previous key), signed with the current key:
    the same header fields and sections, a new tag and ``key_id``; encrypted with the current key if
    it was encrypted (or ``auth.encrypt`` says so)."""
    chunk = parse(data, auth)
    return chunk.to_bytes(auth, encrypt=auth.encrypt or chunk.encrypted)
