"""Capacity of a chunk store: what it holds (``usage``) and keeping it under a size (``gc``).

Both read the store's listing (``KVStore.scan``: key, size, time of last use or write) and, for the
chunks they must place, the chunk's header (two ranged reads: the container's prefix, then the
JSON header; no decoding, no signature check: a header read here only orders deletions).

Keys are ``<model tag>/<codec tag>/<hash>`` (``format.keys``): a *group* is one model at one rung,
and within a group each chunk sits at ``chunk_index`` (from its header) of a prefix chain. A chunk
at index i > 0 is reachable only while its predecessor (index i - 1, same group) is stored. The key
is a chained hash, so a chunk's predecessor cannot be named from the key; what can be known is the
level structure. Hence the rules:

- *orphans* first: a chunk at index i whose group holds no chunk at some index < i can never be
  reached (the fetcher walks each chain from chunk 0): removed whatever the limit;
- then chains are cut from their tail: a chunk may go only when its group holds no chunk at the
  next index, so no stored chunk ever loses a predecessor. Among the chunks allowed to go, the least
  recently used (``time``) goes first, one at a time, until the store is at most ``max_bytes``;
- ``older_than_s`` also removes, in the same order, every chunk unused for that long (still from
  the tail: a chunk whose successor was used recently stays).

So within one group the deepest chunks go first (LRU breaks ties); across groups the least
recently used tail goes first.

"Used" is what the store can tell (``tracks_use``): a file's access or modification time (a local
tier ``touch``es each hit), Redis's idle time, on S3 the ``kvcodec-used`` mark that reads leave
(``S3Store.used``, one ``HeadObject`` per chunk). An HTTP (WebDAV, nginx) store reports only the
last write, and so does S3 with marking off (``touch_s=0``): there ``older_than_s`` is refused
(it would delete a hot prefix written long ago), and ``max_bytes`` goes by write time. Keys outside the key scheme and chunks whose header cannot be read
are counted (``foreign``) and left alone.

``usage(store)`` -> ``{"bytes", "chunks", "groups": [...], "foreign": {...}}``;
``gc(store, max_bytes, older_than_s, dry_run, now)`` -> a report (before, after, deleted, orphans);
``tracks_use(store)`` -> whether the times gc reads are last uses.
"""
from __future__ import annotations

import heapq
import json
import re
import struct
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from ..errors import ConfigError
from ..format.container import MAGIC
from . import Entry, KVStore

_KEY = re.compile(r"^([0-9a-f]{12})/([0-9a-f]{12})/([0-9a-f]{40})$")
_PREFIX = struct.Struct("<4sHI")
_MAX_HEADER = 1 << 20
READERS = 8  # header reads in flight


@dataclass
class Chunk:
    key: str
    size: int
    time: float
    group: Tuple[str, str]  # (model tag, codec tag)
    index: Optional[int] = None


def read_header(store: KVStore, key: str) -> Optional[dict]:
    """The JSON header of a stored chunk, unverified; None if the value is not a chunk container."""
    head = store.get_range(key, 0, _PREFIX.size)
    if head is None or len(head) < _PREFIX.size:
        return None
    magic, _, length = _PREFIX.unpack(head)
    if magic != MAGIC or not 0 < length <= _MAX_HEADER:
        return None
    raw = store.get_range(key, _PREFIX.size, _PREFIX.size + length)
    try:
        header = json.loads(raw) if raw else None
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


def _split(entries: Iterable[Entry]) -> Tuple[List[Chunk], List[Entry]]:
    chunks, foreign = [], []
    for e in entries:
        m = _KEY.match(e.key)
        if m:
            chunks.append(Chunk(e.key, e.size, e.time, (m.group(1), m.group(2))))
        else:
            foreign.append(e)
    return chunks, foreign


def _headers(store: KVStore, keys: List[str]) -> Dict[str, Optional[dict]]:
    return _each(store, keys, lambda k: read_header(store, k))


def _each(store: KVStore, keys: List[str], fn) -> dict:
    if not keys:
        return {}
    with ThreadPoolExecutor(min(READERS, len(keys)), thread_name_prefix="kv-capacity") as pool:
        return dict(zip(keys, pool.map(fn, keys), strict=True))


def _listed(store: KVStore) -> KVStore:
    """The store whose listing ``scan`` gives: a local tier (``store.tiered``, which imports this
    module) lists its ``remote`` store; any other store its own."""
    return getattr(store, "remote", None) or store


def tracks_use(store: KVStore) -> bool:
    """Whether the times gc reads for ``store``'s chunks are last uses (not only last writes)."""
    from .http import HttpStore
    from .s3 import S3Store

    listed = _listed(store)
    if isinstance(listed, S3Store):
        return listed.touch_s > 0
    return not isinstance(listed, HttpStore)


def _rung(header: dict) -> str:
    """The rung spec of a header (``video:12``), as far as the header tells it."""
    from ..format.codecs import SCHEMES

    name = str(header.get("scheme", "?"))
    base = SCHEMES.get(name)
    if base is None or base.quality_param is None:
        return name
    in_layout = base.quality_in == "layout"
    params = header.get("layout_params" if in_layout else "codec_params")
    quality = params.get(base.quality_param) if isinstance(params, dict) else None
    default = (base.layout_params if in_layout else base.codec_params).get(base.quality_param)
    return f"{name}:{quality}" if quality is not None and quality != default else name


def usage(store: KVStore) -> dict:
    """Bytes and chunks in all, and per group (model and rung, named from one header each)."""
    chunks, foreign = _split(store.scan())
    groups: Dict[Tuple[str, str], List[Chunk]] = defaultdict(list)
    for c in chunks:
        groups[c.group].append(c)
    named = _headers(store, [g[0].key for g in groups.values()])
    rows = []
    for (model_tag, codec_tag), members in sorted(groups.items(), key=lambda kv: -sum(c.size for c in kv[1])):
        header = named.get(members[0].key) or {}
        rows.append({"model_tag": model_tag, "codec_tag": codec_tag, "model": header.get("model_id", "?"),
                     "rung": _rung(header) if header else "?", "chunks": len(members),
                     "bytes": sum(c.size for c in members), "oldest": min(c.time for c in members),
                     "newest": max(c.time for c in members)})
    return {"store": store.url, "bytes": sum(c.size for c in chunks) + sum(e.size for e in foreign),
            "chunks": len(chunks), "groups": rows,
            "foreign": {"objects": len(foreign), "bytes": sum(e.size for e in foreign)}}


def gc(store: KVStore, max_bytes: Optional[int] = None, older_than_s: Optional[float] = None,
       dry_run: bool = False, now: Optional[float] = None) -> dict:
    """Delete orphans, then chain tails, least recently used first, until the store holds at most
    ``max_bytes`` and nothing unused for ``older_than_s``; the report of what was (or would be) done."""
    if max_bytes is None and older_than_s is None:
        raise ConfigError("gc needs a limit: max_bytes and/or older_than_s")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
        raise ConfigError(f"gc max_bytes must be an integer >= 0, got {max_bytes!r}")
    if older_than_s is not None and not older_than_s >= 0:
        raise ConfigError(f"gc older_than_s must be >= 0, got {older_than_s!r}")
    if older_than_s is not None and not tracks_use(store):
        raise ConfigError(f"gc older_than_s: the store {store.url} reports when a chunk was written, not when it "
                          "was last used, so an age limit would delete hot prefixes written long ago; "
                          "bound it by max_bytes (oldest writes go first) or by the store's own expiry")
    now = time.time() if now is None else now
    chunks, foreign = _split(store.scan())
    from .s3 import S3Store

    listed = _listed(store)
    if isinstance(listed, S3Store) and listed.touch_s > 0:  # the marks reads leave, not LastModified
        for c, used in zip(chunks, _each(listed, [c.key for c in chunks], listed.used).values(), strict=True):
            if used is not None:
                c.time = used
    unreadable = []
    for c, header in zip(chunks, _headers(store, [c.key for c in chunks]).values(), strict=True):
        index = header.get("chunk_index") if header else None
        if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
            c.index = index
        else:
            unreadable.append(c)
    placed = [c for c in chunks if c.index is not None]
    total = sum(c.size for c in chunks) + sum(e.size for e in foreign)
    before = {"bytes": total, "chunks": len(chunks)}
    deleted: List[Chunk] = []

    def remove(c: Chunk) -> None:
        nonlocal total
        if not dry_run:
            store.delete(c.key)
        deleted.append(c)
        total -= c.size

    # levels[group][index] = that level's chunks, least recently used last (popped first)
    levels: Dict[Tuple[str, str], Dict[int, List[Chunk]]] = defaultdict(lambda: defaultdict(list))
    for c in placed:
        levels[c.group][c.index].append(c)
    orphans = 0
    for by_index in levels.values():
        reach = 0
        while reach in by_index:
            reach += 1
        for i in [i for i in by_index if i > reach]:
            for c in by_index.pop(i):
                remove(c)
                orphans += 1
        for members in by_index.values():
            members.sort(key=lambda c: -c.time)

    # One candidate per group: the least recently used chunk of its deepest level.
    heap: List[Tuple[float, Tuple[str, str]]] = []

    def push(group: Tuple[str, str]) -> None:
        by_index = levels[group]
        if by_index:
            heapq.heappush(heap, (by_index[max(by_index)][-1].time, group))

    for group in list(levels):
        push(group)
    cutoff = None if older_than_s is None else now - older_than_s
    while heap:
        when, group = heap[0]
        over = max_bytes is not None and total > max_bytes
        stale = cutoff is not None and when < cutoff
        if not (over or stale):
            break
        heapq.heappop(heap)
        by_index = levels[group]
        top = max(by_index)
        remove(by_index[top].pop())
        if not by_index[top]:
            del by_index[top]
        push(group)
    return {"store": store.url, "dry_run": dry_run, "max_bytes": max_bytes, "older_than_s": older_than_s,
            "before": before, "after": {"bytes": total, "chunks": len(chunks) - len(deleted)},
            "deleted": {"chunks": len(deleted), "bytes": sum(c.size for c in deleted), "orphans": orphans},
            "unreadable": len(unreadable), "foreign": {"objects": len(foreign), "bytes": sum(e.size for e in foreign)},
            "met": max_bytes is None or total <= max_bytes}
