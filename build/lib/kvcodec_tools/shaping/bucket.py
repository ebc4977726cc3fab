"""The shaping maths, testable without sockets: the userspace proxy's token bucket and parameters,
and the tc tbf parameters of a netns link."""
from __future__ import annotations

import math
from typing import Optional


class TokenBucket:
    """``rate`` bytes/s, at most ``burst`` bytes of credit. ``reserve(n, now)`` takes n bytes
    (the credit may go negative) and returns how long to wait, from ``now``, until they have
    left at the rate."""

    def __init__(self, rate: float, burst: float, now: float = 0.0):
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate > 0 and burst > 0, got rate={rate} burst={burst}")
        self.rate, self.burst = float(rate), float(burst)
        self.tokens, self.t = float(burst), now

    def reserve(self, n: int, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.t) * self.rate)
        self.t = max(self.t, now)
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)


def proxy_params(rate_mbit: Optional[float], delay_ms: float) -> dict:
    """Chunk size, bucket burst and queue depth of the userspace proxy for a rate and delay."""
    rate = None if rate_mbit is None else rate_mbit * 1e6 / 8  # bytes/s
    chunk = 262144 if rate is None else int(min(262144, max(4096, rate * 0.002)))
    burst = None if rate is None else max(2 * chunk, rate * 0.005)
    # enough queued chunks to keep rate x delay in flight (10 Gbit/s when unshaped)
    in_flight = (rate or 1.25e9) * delay_ms / 1e3
    return {"rate": rate, "chunk": chunk, "burst": burst, "queue": int(math.ceil(in_flight / chunk)) + 8}


def tbf_params(rate_mbit: float) -> dict:
    """tbf burst and queue latency for a rate: 4 ms of data (for 10 Gbit/s, 5 MB), at least
    128 KiB so a 64 KiB GSO packet always fits."""
    rate = rate_mbit * 1e6 / 8
    return {"burst": int(max(131072, rate * 0.004)), "latency_ms": 20}
