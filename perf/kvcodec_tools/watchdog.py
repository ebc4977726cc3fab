"""A watchdog that turns a dead python stub into a restart of the whole tritonserver.

Triton 2.51 does not restart a python backend stub that died (SIGKILL, the OOM killer, a native
crash in a decoder): it leaves the stub a zombie, keeps answering ready, and fails every later
request of that model with "Stub process '<instance>' is not healthy". ``Watchdog(server)`` is a
thread that, every ``interval_s``, looks at the server (``TritonServer`` or anything with the same
``alive()``, ``returncode``, ``stubs()``, ``stop(grace_s)`` and ``start(timeout_s, append_log)``):

- the tritonserver process exited, or
- a model instance that had a stub after start-up has no live one now (its stub is gone or a
  zombie, and none runs in its place: so also fewer live stubs than after start-up)

is a fault: it logs which model's stub died (named from the stub's ``model.py`` path, remembered
from start-up since a zombie has no command line left), stops the server (SIGTERM, SIGKILL to its
process group after ``grace_s``: a server with a dead stub fails its requests anyway), starts it
again on the same ports (log appended), counts the restart, records how long it took to be ready
again (``Restart``) and calls ``on_restart(restart)``. A restart whose start fails is counted too
(``ok`` False), and the server being down is a fault again at the next check. Restart-storm guard: a fault when ``max_restarts`` restarts already happened within
``window_s`` seconds stops the server for good; the thread ends and ``exit_code`` is 1.

Contract: start the server first, then ``start()`` the watchdog (it takes the stubs it sees then as
the healthy set); ``stop()`` it before stopping the server yourself, or it restarts what you stop.
``tick()`` is one check (and restart if needed) of the thread's loop, for callers that drive it.
``problem()`` is what a readiness check reads, from any thread: "" while the server it watches is
sound, else why not (a fault not acted on yet, a restart under way, the guard having given up).
``halt()`` sets an event, whose lock is not re-entrant: call it from the main thread's flow, not
from a signal handler (there set a flag the main thread reads, as ``kvcodec serve`` does).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional

from kvcodec_tools.stubs import Stub

log = logging.getLogger("kvcodec.watchdog")


@dataclass(frozen=True)
class Restart:
    number: int  # 1 for the first restart
    reason: str
    stop_s: float  # stopping the faulty server
    start_s: float  # starting it again until every model was ready
    ok: bool  # the new server became ready
    error: str = ""

    @property
    def ready_s(self) -> float:
        """From the fault being seen to the server being ready again."""
        return self.stop_s + self.start_s


class Watchdog:
    def __init__(self, server, interval_s: float = 1.0, on_restart: Optional[Callable[[Restart], None]] = None,
                 max_restarts: int = 5, window_s: float = 300.0, grace_s: float = 5.0, start_timeout_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or max_restarts < 1 or window_s <= 0:
            raise ValueError(f"interval_s ({interval_s}) and window_s ({window_s}) must be > 0, "
                             f"max_restarts ({max_restarts}) >= 1")
        self.server = server
        self.interval_s, self.on_restart = interval_s, on_restart
        self.max_restarts, self.window_s = max_restarts, window_s
        self.grace_s, self.start_timeout_s = grace_s, start_timeout_s
        self.clock = clock
        self.history: List[Restart] = []
        self.exit_code: Optional[int] = None  # 1 once the storm guard gave up
        self._recent: Deque[float] = deque()
        self._healthy: Dict[int, Stub] = {}  # pid -> Stub, as seen after the last start
        self._halt = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._restarting = ""  # the reason of the restart under way ("" when none)

    @property
    def restarts(self) -> int:
        return len(self.history)

    @property
    def gave_up(self) -> bool:
        return self.exit_code is not None

    def start(self) -> "Watchdog":
        """Take the running server's stubs as the healthy set and start checking."""
        if not self.server.alive():
            raise RuntimeError("the watchdog needs a running server: start the server first")
        self._healthy = self._live_stubs()
        self._halt.clear()
        self._thread = threading.Thread(target=self._run, name="kvcodec-watchdog", daemon=True)
        self._thread.start()
        return self

    def halt(self) -> None:
        """Ask the thread to stop, without waiting: it restarts nothing from now on."""
        self._halt.set()

    def join(self, timeout_s: Optional[float] = None) -> bool:
        """Wait up to ``timeout_s`` for the thread to end; whether it still runs."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return self.running()

    def stop(self, timeout_s: Optional[float] = None) -> None:
        """``halt()`` and wait for the thread to end (a restart under way runs to its end first)."""
        self.halt()
        self.join(timeout_s)

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._halt.wait(self.interval_s):
            if not self.tick():
                return

    def tick(self) -> bool:
        """One check; on a fault, restart (or give up). False once the watchdog has given up, or
        when it is halted (it then restarts nothing)."""
        reason = self.fault()
        if reason is None:
            return True
        if self._halt.is_set():
            return False  # the owner is stopping the server: touch nothing
        log.warning("tritonserver must restart: %s", reason)
        if self._storm():
            log.error("%d restarts within %.0f s: the restart-storm guard stops tritonserver for good",
                      len(self._recent), self.window_s)
            self.server.stop(self.grace_s)
            self.exit_code = 1
            return False
        return self._restart(reason)

    def fault(self) -> Optional[str]:
        """Why the server must restart, or None when it runs and every model instance it started
        with still has a live stub (the same one, or one started in its place)."""
        if not self.server.alive():
            return f"tritonserver is not running (exit code {self.server.returncode})"
        now = {stub.pid: stub for stub in self.server.stubs()}
        served = {stub.instance for stub in now.values() if not stub.zombie}
        dead = [f"the stub of model {stub.model} ({stub.instance}, pid {pid}, {stub.model_path}) is "
                f"{'a zombie' if pid in now else 'gone'}"
                for pid, stub in self._healthy.items() if stub.instance not in served]
        return "; ".join(dead) or None

    @property
    def restarting(self) -> str:
        """The reason of the restart under way, "" when none."""
        return self._restarting

    def problem(self) -> str:
        """Why the watched server should take no traffic now, "" when it should: the guard gave up,
        a restart is under way, or a fault the thread has not acted on yet (it checks every
        ``interval_s``). A look at /proc and the server's state: cheap enough for every readiness check."""
        if self.gave_up:
            return f"the watchdog gave up after {self.max_restarts} restarts within {self.window_s:.0f} s"
        restarting = self._restarting
        if restarting:
            return f"restarting tritonserver ({restarting})"
        return self.fault() or ""

    def _storm(self) -> bool:
        """Whether ``max_restarts`` restarts already happened within the last ``window_s``."""
        now = self.clock()
        while self._recent and now - self._recent[0] >= self.window_s:
            self._recent.popleft()
        return len(self._recent) >= self.max_restarts

    def _restart(self, reason: str) -> bool:
        self._restarting = reason
        try:
            return self._restart_server(reason)
        finally:
            self._restarting = ""

    def _restart_server(self, reason: str) -> bool:
        self._recent.append(self.clock())
        t0 = time.monotonic()
        self.server.stop(self.grace_s)
        t1 = time.monotonic()
        if self._halt.is_set():
            return False
        try:
            self.server.start(timeout_s=self.start_timeout_s, append_log=True)
            error = ""
        except (RuntimeError, TimeoutError) as exc:  # ServiceError, NotReady: the next check sees it down
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self._halt.is_set():
            return False
        restart = Restart(len(self.history) + 1, reason, t1 - t0, time.monotonic() - t1, not error, error)
        self.history.append(restart)
        self._healthy = self._live_stubs() if not error else {}
        if error:
            log.error("restart %d: tritonserver did not start again: %s", restart.number, error)
        else:
            log.warning("restart %d: tritonserver ready again after %.1f s (stop %.1f s, start %.1f s)",
                        restart.number, restart.ready_s, restart.stop_s, restart.start_s)
        if self.on_restart is not None:
            try:
                self.on_restart(restart)
            except Exception:  # the callback's fault must not end the watchdog
                log.exception("on_restart failed")
        return True

    def _live_stubs(self) -> Dict[int, Stub]:
        return {stub.pid: stub for stub in self.server.stubs() if not stub.zombie}
