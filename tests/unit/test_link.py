"""Throttled-link maths without sockets: the userspace proxy's token bucket and parameters."""
import pytest

from kvcodec_tools.shaping import TokenBucket, open_link, proxy_params, tbf_params


def test_bucket_burst_then_rate():
    b = TokenBucket(rate=1000.0, burst=100.0, now=0.0)
    assert b.reserve(100, 0.0) == 0.0          # the burst goes at once
    assert b.reserve(100, 0.0) == pytest.approx(0.1)  # then 100 B at 1000 B/s
    assert b.reserve(50, 0.05) == pytest.approx(0.1)  # 50 B refilled, 50 more owed after the 100


def test_bucket_refill_is_capped_at_burst():
    b = TokenBucket(rate=1000.0, burst=100.0, now=0.0)
    b.reserve(100, 0.0)
    assert b.reserve(100, 10.0) == 0.0          # a long idle refills only the burst
    assert b.reserve(1, 10.0) == pytest.approx(0.001)


def test_bucket_long_run_average_is_the_rate():
    rate, burst, chunk = 6.25e6, 65536.0, 12500  # 50 Mbit/s
    b, now, sent = TokenBucket(rate, burst), 0.0, 0
    while sent < 20e6:
        now += b.reserve(chunk, now)  # a sender that waits as told
        sent += chunk
    assert sent / now == pytest.approx(rate, rel=0.01)


def test_bucket_rejects_bad_rates():
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(0, 10)


def test_proxy_params_scale_with_rate_and_delay():
    slow, fast = proxy_params(50, 0), proxy_params(10000, 0)
    assert 4096 <= slow["chunk"] < fast["chunk"] <= 262144
    assert slow["burst"] >= 2 * slow["chunk"]
    # the queue holds rate x delay in flight, so delay does not cut throughput
    p = proxy_params(1000, 20)
    assert p["queue"] * p["chunk"] >= p["rate"] * 0.020
    assert proxy_params(None, 5)["rate"] is None


def test_tbf_burst_fits_gso_and_high_rates():
    assert tbf_params(50)["burst"] >= 65536
    assert tbf_params(10000)["burst"] >= 1_000_000


@pytest.mark.parametrize("kw, field", [({"rate_mbit": 0}, "rate_mbit"), ({"rate_mbit": 10, "delay_ms": -1}, "delay_ms"),
                                       ({"rate_mbit": 10, "mode": "tunnel"}, "mode"),
                                       ({"rate_mbit": 10, "name": "a b"}, "name")])
def test_open_link_validates(kw, field):
    with pytest.raises(ValueError, match=field):
        open_link(**kw)
