"""A circuit breaker for one store: closed, open, half-open, with probes.

Contract:

- ``closed``: calls go to the store. ``failure()`` counts consecutive failures (a store error or a
  call the request stopped waiting for); ``success()`` (any answer, a miss included) resets the
  count. ``failures_to_open`` of them in a row open the breaker.
- ``open``: requests skip the store at once (``allow()`` is False). Once ``cooldown_s`` has passed,
  ``take_probe()`` returns True to exactly one caller and the breaker turns ``half-open``: that
  caller runs one cheap call (the probe) and reports it with ``probe_done(ok)``.
- ``half-open``: requests still skip the store; the probe's success closes the breaker (and resets
  the cooldown), its failure opens it again with the cooldown doubled, up to ``max_cooldown_s``.
  Outcomes of ordinary calls are ignored while the breaker is not closed: only probes decide. A
  probe that ended without asking the store anything (its caller failed first: an encode error)
  is ``probe_void()``: open again, the cooldown unchanged and already over, so the next caller
  probes.

Time comes from ``clock`` (``time.monotonic`` by default; tests pass a fake). Thread-safe.
``STATES`` gives each state its number for a gauge (closed 0, half-open 1, open 2).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

CLOSED, HALF_OPEN, OPEN = "closed", "half-open", "open"
STATES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class Breaker:
    def __init__(self, failures_to_open: int = 1, cooldown_s: float = 1.0, max_cooldown_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures_to_open < 1 or not 0 < cooldown_s <= max_cooldown_s:
            raise ValueError(f"breaker: need failures_to_open >= 1 and 0 < cooldown_s <= max_cooldown_s, got "
                             f"{failures_to_open}, {cooldown_s}, {max_cooldown_s}")
        self.failures_to_open, self.base_cooldown_s, self.max_cooldown_s = failures_to_open, cooldown_s, max_cooldown_s
        self.clock = clock
        self.state = CLOSED
        self.cooldown_s = cooldown_s
        self.failures = 0  # consecutive, while closed
        self.opened = 0  # times the breaker opened (from closed or after a failed probe)
        self.last_error = ""
        self._opened_at = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether calls may go to the store now."""
        with self._lock:
            return self.state == CLOSED

    def success(self) -> None:
        with self._lock:
            if self.state == CLOSED:
                self.failures = 0

    def failure(self, error: str = "") -> None:
        with self._lock:
            if self.state != CLOSED:
                return
            self.failures += 1
            self.last_error = error or self.last_error
            if self.failures >= self.failures_to_open:
                self._open()

    def take_probe(self) -> bool:
        """True for the one caller that should probe the store now (open, cooldown over)."""
        with self._lock:
            if self.state != OPEN or self.clock() < self._opened_at + self.cooldown_s:
                return False
            self.state = HALF_OPEN
            return True

    def probe_done(self, ok: bool, error: str = "") -> None:
        with self._lock:
            if self.state != HALF_OPEN:
                return
            if ok:
                self.state, self.failures, self.cooldown_s = CLOSED, 0, self.base_cooldown_s
            else:
                self.last_error = error or self.last_error
                self.cooldown_s = min(self.cooldown_s * 2, self.max_cooldown_s)
                self._open()

    def probe_void(self) -> None:
        """The probe said nothing of the store: open again, the next ``take_probe()`` succeeds."""
        with self._lock:
            if self.state == HALF_OPEN:
                self.state, self._opened_at = OPEN, self.clock() - self.cooldown_s

    def _open(self) -> None:
        self.state, self._opened_at = OPEN, self.clock()
        self.opened += 1

    def describe(self) -> str:
        with self._lock:
            if self.state == CLOSED:
                return CLOSED
            left = max(0.0, self._opened_at + self.cooldown_s - self.clock())
            when = "a probe is under way" if self.state == HALF_OPEN else f"next probe in {left:.1f}s"
            return f"{self.state} ({when}; last error: {self.last_error or 'unknown'})"
