"""What things cost on this machine and link: the adaptive fetcher's inputs.

``CostModel`` keeps, per rung (a scheme identity), bytes, decode and restore seconds per token;
per store URL, the link's rate (bytes/s) and round-trip seconds; and the prefill seconds per
token of the engine. Each is an exponentially weighted average of what was measured: ingest
records bytes, decode and restore time (the encoder decodes and restores its own output once; so
does write-back, for each rung it stores) and prefill time; the
``kv_fetch`` step records each transfer; the ``llm`` step records each chunk's decode and restore
time and each prefill. The values live in one small JSON file (``<home>/costs.json``) so the
serving steps, which run in separate processes, share them; writes merge under a file lock and
replace the file atomically. Unknown values fall back to priors, never to errors.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

ALPHA = 0.5  # weight of a new measurement

# Priors, used until something is measured (conservative: a rung costs like raw fp16 bytes).
PRIOR_DECODE_S_PER_TOKEN = 1e-3
PRIOR_RESTORE_S_PER_TOKEN = 1e-4
PRIOR_PREFILL_S_PER_TOKEN = 5e-3


@dataclass
class RungCost:
    bytes_per_token: float
    decode_s_per_token: float
    restore_s_per_token: float


def _ewma(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class CostModel:
    def __init__(self, path: Optional[Path] = None, link_mbps: float = 1000.0, fp16_bytes_per_token: float = 0.0):
        self.path = Path(path) if path else None
        self.prior_rate = link_mbps * 1e6 / 8
        self.fp16_bytes_per_token = fp16_bytes_per_token
        self.data: Dict[str, dict] = {"rungs": {}, "links": {}, "prefill": {}}
        self._mtime = 0.0
        self.reload()

    # -- reading -----------------------------------------------------------------------------
    def reload(self) -> None:
        """Re-read the file if another process changed it."""
        if not self.path:
            return
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return
        if mtime == self._mtime:
            return
        loaded = _read(self.path)
        if loaded is not None:
            self.data, self._mtime = loaded, mtime

    def rung(self, identity: str) -> RungCost:
        r = self.data["rungs"].get(identity, {})
        return RungCost(r.get("bytes_per_token") or self.fp16_bytes_per_token,
                        r.get("decode_s_per_token", PRIOR_DECODE_S_PER_TOKEN),
                        r.get("restore_s_per_token", PRIOR_RESTORE_S_PER_TOKEN))

    def known(self, identity: str) -> bool:
        return "bytes_per_token" in self.data["rungs"].get(identity, {})

    def link(self, store_url: str, prior_mbps: Optional[float] = None) -> tuple:
        """(rate in bytes/s, round-trip seconds) of the link to ``store_url``; ``prior_mbps``: its rate
        until one is measured (default: the deployment's ``link_mbps``)."""
        link = self.data["links"].get(store_url, {})
        s_per_byte = link.get("s_per_byte")
        prior = self.prior_rate if prior_mbps is None else prior_mbps * 1e6 / 8
        return (1.0 / s_per_byte if s_per_byte else prior), link.get("rtt_s", 0.0)

    @property
    def prefill_s_per_token(self) -> float:
        return self.data["prefill"].get("s_per_token", PRIOR_PREFILL_S_PER_TOKEN)

    # -- estimates ---------------------------------------------------------------------------
    def transfer_s(self, store_url: str, nbytes: float, prior_mbps: Optional[float] = None) -> float:
        rate, rtt = self.link(store_url, prior_mbps)
        return rtt + nbytes / rate

    # -- recording ---------------------------------------------------------------------------
    def observe_transfer(self, store_url: str, nbytes: int, seconds: float, save: bool = True,
                         fresh: bool = False) -> None:
        """One GET of ``nbytes`` took ``seconds``. Small objects say more about the round trip.
        The rate is averaged as seconds per byte, so that one slow transfer moves it at once;
        ``fresh``: the measurement replaces the rate (the fetcher's link probe, taken when the
        estimate made it recompute, so that one slow moment does not keep reuse off for good)."""
        if seconds <= 0:
            return

        def update(data):
            link = data["links"].setdefault(store_url, {})
            rtt = link.get("rtt_s", 0.0)
            if nbytes >= 64 * 1024:
                value = max(seconds - rtt, seconds * 0.1) / nbytes
                link["s_per_byte"] = value if fresh else _ewma(link.get("s_per_byte"), value)
            else:
                link["rtt_s"] = _ewma(link.get("rtt_s"), seconds)
        self._update(update, save)

    def observe_rung(self, identity: str, tokens: int, nbytes: Optional[int] = None,
                     decode_s: Optional[float] = None, restore_s: Optional[float] = None, save: bool = True) -> None:
        if tokens <= 0:
            return

        def update(data):
            r = data["rungs"].setdefault(identity, {})
            for name, value in (("bytes_per_token", nbytes), ("decode_s_per_token", decode_s),
                                ("restore_s_per_token", restore_s)):
                if value is not None and value >= 0:
                    r[name] = _ewma(r.get(name), value / tokens)
        self._update(update, save)

    def observe_prefill(self, tokens: int, seconds: float, save: bool = True) -> None:
        if tokens < 16 or seconds <= 0:  # a handful of tokens says little about a long prefill
            return
        self._update(lambda data: data["prefill"].__setitem__(
            "s_per_token", _ewma(data["prefill"].get("s_per_token"), seconds / tokens)), save)

    def _update(self, fn, save: bool) -> None:
        if not (self.path and save):
            fn(self.data)
            return
        with _locked(self.path):
            current = _read(self.path) or self.data
            fn(current)
            current["updated"] = time.time()
            _write(self.path, current)
            self.data = current
            try:
                self._mtime = self.path.stat().st_mtime
            except OSError:
                pass


def for_settings(settings, fp16_bytes_per_token: float) -> CostModel:
    """The cost model that every process of one deployment shares (``<home>/costs.json``)."""
    return CostModel(Path(settings.home) / "costs.json", settings.link_mbps, fp16_bytes_per_token)


def record_request(costs: CostModel, stats, chunk_tokens: int) -> None:
    """What the ``llm`` step learned from one request (a ``serving.stats.RequestStats``): each
    chunk's decode and restore time and size per rung, and the prefill time when nothing was reused."""
    for chunk in stats.chunks:
        if chunk.get("status") == "ok" and chunk.get("scheme_id"):
            s = chunk.get("s", {})
            costs.observe_rung(chunk["scheme_id"], chunk_tokens, chunk.get("bytes"), s.get("decode"), s.get("restore"))
    if not stats.reused_tokens and stats.compute_first_token_s:
        costs.observe_prefill(int(stats.computed_tokens or 0), float(stats.compute_first_token_s))


def _read(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    for k in ("rungs", "links", "prefill"):
        if not isinstance(data.get(k), dict):
            data[k] = {}
    return data


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".costs-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
