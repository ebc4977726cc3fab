"""The device mode (a quiet many-core machine, no model there): planes saved with ``--save-planes``,
each candidate timed in its own process pinned to its own physical core (x265's pool of one
thread), then the threading options on two pinned cores: x265 frame threads, and two chunks at
once (``device_main``, ``two_cores``). No distortion.
"""
from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np

from .encode_candidates import time_candidates
from .encode_common import BASE, CANDIDATES, Candidate, _coder


def _pinned(args) -> Dict[str, Any]:
    core, cand, path, rounds = args
    os.sched_setaffinity(0, {core})
    planes = list(np.load(path).values())
    res = time_candidates(planes, [cand], rounds, pools=1)[cand.name]
    res.pop("_streams")
    return res


def physical_cores() -> List[List[int]]:
    """The logical CPUs this process may use, grouped by physical core (SMT siblings together)."""
    groups: Dict[str, List[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            key = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            key = str(cpu)
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def device_main(a) -> Dict[str, Any]:
    import multiprocessing as mp

    planes = list(np.load(a.planes).values())
    phys = physical_cores()
    cores = [g[0] for g in phys]  # one logical CPU per physical core
    out: Dict[str, Any] = {"logical_cpus": sum(len(g) for g in phys), "physical_cores": len(phys),
                           "chunks": len(planes)}
    # 1. each candidate alone on its own physical core (x265's pool of one thread): its CPU cost
    wanted = [n for n in a.candidates.split(",") if n]
    cands = [c for c in CANDIDATES if c.threads == 1 and (not wanted or c.name in wanted or c.name == BASE)]
    spare = cores[2:] or cores  # the first two physical cores are for part 2
    jobs = [(spare[k % len(spare)], c, a.planes, a.rounds) for k, c in enumerate(cands)]
    with mp.get_context("spawn").Pool(min(len(jobs), len(spare))) as pool:
        out["one_core"] = dict(zip([c.name for c in cands], pool.map(_pinned, jobs), strict=True))
    for n, r in out["one_core"].items():
        print(f"one core: {n} {r['s_per_chunk']:.2f} s/chunk", flush=True)
    # 2. the threading options on two cores, pinned: x265 frame threads, two chunks at once
    os.sched_setaffinity(0, set(cores[:2]))  # two physical cores, one logical CPU of each
    out["two_cores"] = two_cores(planes, a.rounds, cands)
    out["two_cores_cpus"] = cores[:2]
    return out


def two_cores(planes: Sequence[np.ndarray], rounds: int, cands: Sequence[Candidate], pools: int = 2) -> Dict[str, Any]:
    """Seconds per chunk over all chunks: one encoder with 1 or 2 frame threads, and a pool of two
    encoders (1 frame thread each) over the chunks, interleaved over ``rounds``."""
    ways: Dict[str, Any] = {}
    for cand in cands:
        for ft in (1, 2):
            c = Candidate(cand.name, cand.preset, cand.x265, ft)
            ways[f"{cand.name} frame-threads={ft}"] = (c, 1)
        ways[f"{cand.name} 2 chunk workers"] = (cand, 2)
    secs: Dict[str, List[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for k, (c, workers) in ways.items():
            t0 = time.perf_counter()
            with ThreadPoolExecutor(workers) as ex:
                list(ex.map(lambda p, c=c: _coder(c, pools=pools).encode(p), planes))
            secs[k].append((time.perf_counter() - t0) / len(planes))
            print(f"two cores: {k} {secs[k][-1]:.2f} s/chunk", flush=True)
    return {k: round(statistics.median(v), 3) for k, v in secs.items()}
