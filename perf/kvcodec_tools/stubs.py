"""A tritonserver's python backend stub processes, read from ``/proc``: ``Stub`` (one stub: pid,
state, its model; a zombie too), ``read_stub(pid)``, ``stubs_of(server_pid)`` and ``children(pid)``.
``kvcodec_tools.tritonserver`` lists a server's stubs with it and ``kvcodec_tools.watchdog`` watches
them; both import this module, which imports neither.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

STUB = "triton_python_backend_stub"


@dataclass(frozen=True)
class Stub:
    """One python backend stub process. A live stub runs as ``triton_python_backend_stub MODEL.py
    REGION DEFAULT_SIZE GROWTH PARENT_PID BACKEND_DIR IPC_HANDLE INSTANCE_NAME RUNTIME``; a zombie
    has no command line left (``model_path`` and ``instance`` are then "")."""
    pid: int
    state: str  # proc(5)'s state letter: R, S, D, ... ; Z for a zombie
    model_path: str = ""
    instance: str = ""

    @property
    def zombie(self) -> bool:
        return self.state == "Z"

    @property
    def model(self) -> str:
        """The model's name: the folder above the version folder of its ``model.py`` ("" if unknown)."""
        parts = Path(self.model_path).parts
        return parts[-3] if len(parts) >= 3 else ""


def _stat(pid: int) -> List[str]:
    """``/proc/PID/stat`` as [comm, state, ppid, ...] (OSError if the process is gone)."""
    head, _, rest = Path(f"/proc/{pid}/stat").read_text().rpartition(")")
    return [head.partition("(")[2], *rest.split()]


def children(pid: int) -> List[int]:
    """The PIDs whose parent is ``pid``, zombies included, from one pass over /proc."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if int(_stat(int(name))[2]) == pid:
                    out.append(int(name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return sorted(out)


def read_stub(pid: int) -> Optional[Stub]:
    """``pid`` as a ``Stub``, or None if it is gone or runs something else. A zombie is recognised
    by its name (the kernel keeps the first 15 characters of the stub's name)."""
    try:
        comm, state = _stat(pid)[:2]
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except (OSError, ValueError):
        return None
    if argv and Path(argv[0]).name == STUB:
        return Stub(pid, state, argv[1] if len(argv) > 1 else "", argv[8] if len(argv) > 8 else "")
    if not argv and state == "Z" and comm == STUB[:15]:
        return Stub(pid, state)
    return None


def stubs_of(pid: int) -> List[Stub]:
    """The python backend stubs among ``pid``'s children, zombies included."""
    return [stub for stub in map(read_stub, children(pid)) if stub is not None]
