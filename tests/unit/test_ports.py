"""Port runs for servers that bind several ports (SeaweedFS, Redis Cluster) stay out of the range
the kernel hands to outgoing connections, so none is taken between the pick and the bind."""
import socket

import pytest

from kvcodec_tools.ports import ephemeral_range, free_port_run, port_is_free
from kvcodec_tools.procs import ServiceError


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


@pytest.mark.parametrize("n,offsets", [(7, (0, 10000)), (3, (0, 10000)), (1, (0,))])
def test_no_port_of_a_run_is_in_the_ephemeral_range(n, offsets):
    lo, hi = ephemeral_range()
    for _ in range(20):
        base = free_port_run(n, offsets=offsets)
        ports = [base + i + o for i in range(n) for o in offsets]
        assert all(not lo <= p <= hi for p in ports), (base, lo, hi)
        assert all(port_is_free("127.0.0.1", p) for p in ports)


def test_a_run_that_would_straddle_the_range_is_never_picked():
    # ports 30115-30125 play the ephemeral range: bases 30104-30125 each have a port in it
    for _ in range(10):
        base = free_port_run(2, offsets=(0, 10), lo=30100, hi=30200, avoid=(30115, 30125))
        ports = {base, base + 1, base + 10, base + 11}
        assert not any(30115 <= p <= 30125 for p in ports), base


def test_a_taken_port_is_skipped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port_run(2)))
        s.listen()
        taken = s.getsockname()[1]
        assert free_port_run(1, lo=taken, hi=taken + 2, avoid=(0, 0)) == taken + 1


def test_no_room_is_a_service_error():
    with pytest.raises(ServiceError, match="outside the ephemeral range"):
        free_port_run(4, offsets=(0, 10000), lo=30000, hi=40000, avoid=(20000, 45000))
