"""The footprint of a process tree, from ``/proc`` (pure reads): for a root process and all its
descendants (tritonserver and its python backend stubs), resident memory (sum of RSS), open file
descriptors (and of those, sockets), live processes (and zombies), threads, and the python
backend's shared memory: the size of the regions in ``/dev/shm`` that the live stubs name on their command line
(``triton_python_backend_stub MODEL.py REGION ...``, the region prefix being
``triton_python_backend_shm_region_``); ``shm_machine_bytes`` adds every ``triton_python_backend``
file of the machine (other servers' too: information only). ``sample_tree`` reads it all at once;
``stub_pids`` names the live stubs' PIDs by model instance.
"""
from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

STUB = "triton_python_backend_stub"
SHM_MARK = "triton_python_backend"  # in every region name: "triton_python_backend_shm_region_<uuid>"
SHM_DIR = Path("/dev/shm")


@dataclass
class ProcInfo:
    pid: int
    state: str  # R, S, Z (zombie), ...
    rss_bytes: int
    threads: int
    fds: int
    argv: List[str]
    sockets: int = 0  # of the fds, those that are sockets (connections and listeners)


def _stat_fields(pid: int) -> List[str]:
    """``/proc/PID/stat`` after the command name: [state, ppid, ...] (field 3 of proc(5) first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(root: int) -> List[int]:
    """Every process below ``root`` (children, their children, ...), from one pass over /proc."""
    children: Dict[int, List[int]] = defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                children[int(_stat_fields(int(name))[1])].append(int(name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return sorted(out)


def read_proc(pid: int) -> Optional[ProcInfo]:
    """One process's state, RSS, threads, open fds and command line; None if it is gone."""
    try:
        fields = _stat_fields(pid)
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            names = []  # a zombie has none left to list
        sockets = 0
        for name in names:
            with contextlib.suppress(OSError):
                sockets += os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:")
    except OSError:
        return None
    return ProcInfo(pid, fields[0], int(fields[21]) * os.sysconf("SC_PAGE_SIZE"), int(fields[17]), len(names), argv,
                    sockets)


def stub_regions(procs: Iterable[ProcInfo]) -> Dict[str, str]:
    """``{model instance: shm region name}`` of the python backend stubs among ``procs`` (live ones):
    a stub runs as ``triton_python_backend_stub MODEL.py REGION DEFAULT_SIZE GROWTH PARENT_PID
    BACKEND_DIR IPC_HANDLE INSTANCE_NAME RUNTIME``."""
    out = {}
    for p in procs:
        if p.state != "Z" and p.argv and Path(p.argv[0]).name == STUB and len(p.argv) > 8:
            out[p.argv[8]] = p.argv[2]
    return out


def stub_pids(root: int) -> Dict[str, int]:
    """``{model instance ("kv_decode_0_0"): pid}`` of the live python stubs below ``root``."""
    out = {}
    for p in filter(None, map(read_proc, descendants(root))):
        if p.state != "Z" and p.argv and Path(p.argv[0]).name == STUB and len(p.argv) > 8:
            out[p.argv[8]] = p.pid
    return out


def shm_usage(names: Iterable[str], shm_dir: Path = SHM_DIR) -> Tuple[int, int, int]:
    """(size, allocated bytes, files) of the files ``names`` in ``shm_dir``; missing ones count 0.
    Size is what the region was grown to (it never shrinks: a leak shows as growth); allocated is
    the pages touched in it."""
    size = allocated = files = 0
    for name in set(names):
        try:
            st = (Path(shm_dir) / name).stat()
        except OSError:
            continue
        size, allocated, files = size + st.st_size, allocated + st.st_blocks * 512, files + 1
    return size, allocated, files


def shm_matching(mark: str = SHM_MARK, shm_dir: Path = SHM_DIR) -> List[str]:
    """Names of the files in ``shm_dir`` whose name contains ``mark``."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if mark in n)
    except OSError:
        return []


def sample_tree(root: int, shm_dir: Path = SHM_DIR) -> dict:
    """The footprint of ``root`` and all its descendants, now (see the module docstring)."""
    procs = [p for p in map(read_proc, [root, *descendants(root)]) if p is not None]
    live = [p for p in procs if p.state != "Z"]
    size, allocated, files = shm_usage(stub_regions(live).values(), shm_dir)
    machine, _, _ = shm_usage(shm_matching(SHM_MARK, shm_dir), shm_dir)
    return {"rss_bytes": sum(p.rss_bytes for p in live), "fds": sum(p.fds for p in live),
            "processes": len(live), "zombies": len(procs) - len(live), "threads": sum(p.threads for p in live),
            "sockets": sum(p.sockets for p in live),
            "shm_bytes": size, "shm_allocated_bytes": allocated, "shm_regions": files, "shm_machine_bytes": machine}


class Footprint:
    """CPU seconds (user + system) and peak RSS of process trees, sampled while a method runs."""

    def __init__(self) -> None:
        self.roots: Dict[str, int] = {}
        self.peak_rss: Dict[str, int] = {}
        self.cpu_s: Dict[str, float] = {}

    def watch(self, name: str, pid: Optional[int]) -> None:
        if pid:
            self.roots[name] = pid

    def sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        for name, root in self.roots.items():
            rss, cpu = 0, 0.0
            for pid in [root, *descendants(root)]:
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    cpu += (int(fields[11]) + int(fields[12])) / tick
                    rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                except (OSError, IndexError, ValueError):
                    continue
            self.peak_rss[name] = max(self.peak_rss.get(name, 0), rss)
            self.cpu_s[name] = max(self.cpu_s.get(name, 0.0), round(cpu, 2))

    def report(self) -> Dict[str, dict]:
        return {n: {"cpu_s": self.cpu_s.get(n, 0.0), "peak_rss_mb": round(self.peak_rss.get(n, 0) / 2**20, 1)}
                for n in self.roots}
