"""``kvcodec_tools.watchdog``'s logic against a fake server (start, stop, alive, stubs: no tritonserver): a
dead or zombie stub is one restart, a server that exits is one too, a failed start is retried,
the restart-storm guard gives up and stops the server, nothing restarts while all is alive, and
the thread ends on ``stop()``. Then ``kvcodec_tools.tritonserver``'s stub listing against real child
processes of this test that look like stubs (their command line and name), killed into zombies.
The thread's tests wait on events the fake sets, with timeouts: no sleeping and hoping."""
from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from kvcodec_tools.tritonserver import STUB, Stub, stubs_of
from kvcodec_tools.watchdog import Restart, Watchdog

MODELS = ("kv_fetch", "kv_decode", "kv_restore", "llm")
WAIT_S = 10.0  # the most any event below may take


class FakeServer:
    """What the watchdog uses of ``TritonServer``: four stubs per start (fresh PIDs), ``kill`` and
    ``crash`` to damage it, counts of starts, stops and stub listings."""

    def __init__(self, fail_starts: int = 0) -> None:
        self.fail_starts = fail_starts
        self.starts = self.stops = self.checks = 0
        self.append_logs: list = []
        self.returncode = None
        self._running = False
        self._next_pid = 1000
        self._table: dict = {}
        self._lock = threading.Lock()
        self._checked = threading.Condition(self._lock)
        self.start()

    def start(self, timeout_s: float = 180.0, append_log: bool = False) -> "FakeServer":
        with self._lock:
            self.starts += 1
            self.append_logs.append(append_log)
            if self.fail_starts:
                self.fail_starts -= 1
                self.returncode = 1
                raise RuntimeError("tritonserver exited (1) while starting: ...\nlog tail")
            self._running, self.returncode = True, None
            self._table = {}
            for model in MODELS:
                self._next_pid += 1
                self._table[self._next_pid] = Stub(self._next_pid, "S", f"/repo/model_repository/{model}/1/model.py",
                                                   f"{model}_0_0")
        return self

    def stop(self, grace_s: float = 30.0) -> None:
        with self._lock:
            self.stops += 1
            self.grace_s = grace_s
            self._running, self._table = False, {}

    def alive(self) -> bool:
        return self._running

    def stubs(self) -> list:
        with self._lock:
            self.checks += 1
            self._checked.notify_all()
            return list(self._table.values())

    def kill(self, model: str, zombie: bool = False) -> int:
        """The model's stub dies: left a zombie (no command line any more) or gone."""
        with self._lock:
            pid = next(pid for pid, stub in self._table.items() if stub.instance == f"{model}_0_0")
            if zombie:
                self._table[pid] = replace(self._table[pid], state="Z", model_path="", instance="")
            else:
                del self._table[pid]
            return pid

    def crash(self) -> None:
        with self._lock:
            self._running, self.returncode, self._table = False, -11, {}

    def wait_checks(self, n: int) -> None:
        """Until the watchdog has listed the stubs ``n`` more times."""
        with self._lock:
            target = self.checks + n
            assert self._checked.wait_for(lambda: self.checks >= target, WAIT_S), "the watchdog stopped checking"


def watched(server, **kw):
    """A running watchdog (10 ms interval) and the queue its restarts arrive on."""
    restarts: "queue.Queue[Restart]" = queue.Queue()
    watchdog = Watchdog(server, interval_s=0.01, on_restart=restarts.put, **kw).start()
    return watchdog, restarts


@pytest.fixture
def cleanup():
    started = []
    yield started.append
    for watchdog in started:
        watchdog.stop(WAIT_S)
        assert not watchdog.running()


@pytest.mark.parametrize("zombie", [False, True], ids=["gone", "zombie"])
def test_a_dead_stub_triggers_one_restart(cleanup, caplog, zombie):
    server = FakeServer()
    watchdog, restarts = watched(server)
    cleanup(watchdog)
    with caplog.at_level(logging.WARNING, logger="kvcodec.watchdog"):
        pid = server.kill("kv_decode", zombie=zombie)
        restart = restarts.get(timeout=WAIT_S)
        server.wait_checks(20)  # the new server's stubs are the healthy set: no second restart
    assert restart.number == 1 and restart.ok and restart.ready_s >= 0
    state = "a zombie" if zombie else "gone"
    assert restart.reason == (f"the stub of model kv_decode (kv_decode_0_0, pid {pid}, "
                              f"/repo/model_repository/kv_decode/1/model.py) is {state}")
    assert (server.starts, server.stops, server.append_logs) == (2, 1, [False, True])  # same server, log appended
    assert server.grace_s == watchdog.grace_s
    assert watchdog.restarts == 1 and restarts.empty() and not watchdog.gave_up
    assert f"tritonserver must restart: {restart.reason}" in caplog.text
    assert "restart 1: tritonserver ready again after" in caplog.text


def test_a_server_that_exits_is_restarted(cleanup):
    server = FakeServer()
    watchdog, restarts = watched(server)
    cleanup(watchdog)
    server.crash()
    restart = restarts.get(timeout=WAIT_S)
    assert restart.reason == "tritonserver is not running (exit code -11)" and restart.ok
    assert server.alive() and server.starts == 2


def test_a_failed_start_is_counted_and_tried_again(cleanup):
    server = FakeServer()
    watchdog, restarts = watched(server)
    cleanup(watchdog)
    server.fail_starts = 1
    server.kill("llm")
    failed, retried = restarts.get(timeout=WAIT_S), restarts.get(timeout=WAIT_S)
    assert not failed.ok and failed.error == "tritonserver exited (1) while starting: ..."
    assert retried.ok and retried.reason == "tritonserver is not running (exit code 1)"
    assert watchdog.restarts == 2 and server.alive()


def test_the_restart_storm_guard_stops_the_server_and_exits_non_zero():
    server = FakeServer()
    watchdog, restarts = watched(server, max_restarts=2, window_s=300)
    for n in (1, 2):
        server.kill("kv_decode")
        assert restarts.get(timeout=WAIT_S).number == n
    server.kill("kv_decode")  # a third fault within the window
    assert not watchdog.join(WAIT_S), "the watchdog should give up and end"
    assert watchdog.gave_up and watchdog.exit_code == 1 and watchdog.restarts == 2
    assert not server.alive() and (server.starts, server.stops) == (3, 3)  # stopped, not started again
    assert restarts.empty()


def test_restarts_further_apart_than_the_window_do_not_trip_the_guard(cleanup):
    now = [0.0]
    server = FakeServer()
    watchdog, restarts = watched(server, max_restarts=2, window_s=300, clock=lambda: now[0])
    cleanup(watchdog)
    for n in (1, 2, 3, 4):
        server.kill("kv_fetch")
        assert restarts.get(timeout=WAIT_S).number == n
        now[0] += 200.0  # two restarts are never within 300 s of a third
    assert not watchdog.gave_up and watchdog.running()


def test_nothing_restarts_while_everything_is_alive(cleanup):
    server = FakeServer()
    watchdog, restarts = watched(server)
    cleanup(watchdog)
    server.wait_checks(50)
    assert watchdog.fault() is None
    assert restarts.empty() and watchdog.restarts == 0 and (server.starts, server.stops) == (1, 0)


def test_a_stub_started_in_the_place_of_a_dead_one_is_no_fault():
    server = FakeServer()
    watchdog = Watchdog(server)
    watchdog._healthy = {s.pid: s for s in server.stubs()}  # what start() takes, without the thread
    pid = server.kill("kv_restore")
    assert "kv_restore" in watchdog.fault()
    server._table[pid + 100] = Stub(pid + 100, "S", "/repo/model_repository/kv_restore/1/model.py", "kv_restore_0_0")
    assert watchdog.fault() is None


def test_the_thread_stops_on_stop_at_once():
    server = FakeServer()
    watchdog = Watchdog(server, interval_s=3600).start()  # it would not check for an hour
    assert watchdog.running()
    t0 = time.monotonic()
    watchdog.stop(WAIT_S)
    assert not watchdog.running() and time.monotonic() - t0 < 2
    assert (server.starts, server.stops, watchdog.restarts) == (1, 0, 0)


def test_a_halted_watchdog_restarts_nothing():
    server = FakeServer()
    watchdog = Watchdog(server, interval_s=0.01).start()
    watchdog.stop(WAIT_S)
    server.kill("kv_decode")
    assert watchdog.tick() is False  # it sees the fault but touches nothing: its owner is stopping
    assert (server.starts, server.stops, watchdog.restarts) == (1, 0, 0)


def test_the_watchdog_needs_a_running_server():
    server = FakeServer()
    server.stop()
    with pytest.raises(RuntimeError, match="start the server first"):
        Watchdog(server).start()
    with pytest.raises(ValueError, match="max_restarts"):
        Watchdog(server, max_restarts=0)


# -- kvcodec_tools.tritonserver's stub listing, against processes that look like stubs ---------------------
@pytest.fixture
def fake_stub(tmp_path):
    """A child of this process with a stub's command line (``triton_python_backend_stub MODEL.py
    REGION ... INSTANCE``) and name: Python runs the "model.py", which renames itself and sleeps."""
    model = tmp_path / "repo" / "kv_decode" / "1" / "model.py"
    model.parent.mkdir(parents=True)
    model.write_text(f"import sys, time\nopen('/proc/self/comm', 'w').write({STUB!r})\nprint(flush=True)\n"
                     "time.sleep(300)\n")
    argv = [str(tmp_path / STUB), str(model), "region", "1", "2", str(os.getpid()), "backends", "ipc",
            "kv_decode_0_0"]
    proc = subprocess.Popen(argv, executable=sys.executable, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"\n"  # renamed
    yield proc, model
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=WAIT_S)
    proc.stdout.close()


def test_the_stubs_of_a_process_are_its_stub_children_zombies_included(fake_stub):
    proc, model = fake_stub
    (stub,) = stubs_of(os.getpid())
    assert stub == Stub(proc.pid, stub.state, str(model), "kv_decode_0_0")
    assert stub.model == "kv_decode" and not stub.zombie
    os.kill(proc.pid, signal.SIGKILL)  # not reaped: a zombie, its command line gone
    deadline = time.monotonic() + WAIT_S
    while not (found := stubs_of(os.getpid())) or not found[0].zombie:
        assert time.monotonic() < deadline, found
        time.sleep(0.01)
    assert found == [Stub(proc.pid, "Z")] and found[0].model == ""
    proc.wait(timeout=WAIT_S)  # reaped: gone
    assert stubs_of(os.getpid()) == []
