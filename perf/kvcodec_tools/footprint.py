"""A process tree's footprint over a run, judged (pure): the samples of the first window after a
warm-up and of the last window (``windows``), each measure's growth between them (``growth``), and
the flatness rule (``flatness``: RSS grows by less than ``RSS_GROWTH_LIMIT`` of its first median;
fds, processes and shm not at all). ``kvcodec soak`` and ``kvcodec soak --chaos`` judge by it.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence, Tuple

RSS_GROWTH_LIMIT = 0.05  # of the first window's median RSS
GROWTH_KEYS = ("rss_bytes", "shm_bytes", "fds", "processes")


def windows(samples: Sequence[dict], warmup_s: float, window_s: float) -> Tuple[List[dict], List[dict]]:
    """The samples of the first window after the warm-up, [warmup_s, warmup_s + window_s), and of
    the last window, the last ``window_s`` seconds up to the last sample."""
    if not samples:
        return [], []
    end = max(s["t_s"] for s in samples)
    first = [s for s in samples if warmup_s <= s["t_s"] < warmup_s + window_s]
    last = [s for s in samples if s["t_s"] > end - window_s and s["t_s"] >= warmup_s + window_s]
    return first, last


def growth(samples: Sequence[dict], warmup_s: float, window_s: float,
           keys: Sequence[str] = GROWTH_KEYS) -> Tuple[Dict[str, Optional[float]], Dict[str, Optional[float]]]:
    """({key: last window's median - first window's median}, {key: first window's median}); None
    for every key when a window has no sample (the run was too short for both)."""
    first, last = windows(samples, warmup_s, window_s)
    if not first or not last:
        return {k: None for k in keys}, {k: None for k in keys}
    base = {k: statistics.median(s[k] for s in first) for k in keys}
    return {k: statistics.median(s[k] for s in last) - base[k] for k in keys}, base


def flatness(grown: Dict[str, Optional[float]], base: Dict[str, Optional[float]],
             rss_limit: float = RSS_GROWTH_LIMIT) -> Tuple[bool, List[str]]:
    """(flat, why not): RSS growth under ``rss_limit`` of its first median, no growth of fds,
    processes and shm."""
    why = []
    if any(grown.get(k) is None for k in GROWTH_KEYS):
        return False, ["too short: no samples in the first or the last window"]
    if grown["rss_bytes"] >= rss_limit * max(base["rss_bytes"], 1):
        why.append(f"RSS grew {grown['rss_bytes'] / 2**20:.1f} MiB "
                   f"({100 * grown['rss_bytes'] / max(base['rss_bytes'], 1):.1f}% >= {100 * rss_limit:g}%)")
    for key in ("fds", "processes", "shm_bytes"):
        if grown[key] > 0:
            why.append(f"{key} grew by {grown[key]:g}")
    return not why, why
