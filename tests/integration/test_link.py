"""Throttled links (kvcodec_tools.shaping): the achieved rate, the added delay and the teardown, in both
modes. Netns tests need root (CI runs as root); they skip, saying so, only when not root."""
import json
import os
import subprocess
import sys

import pytest

from kvcodec_tools.shaping import byte_source, main, measure, open_link

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="netns links need root (ip netns add, tc)")
MODES = [pytest.param("netns", marks=needs_root), "userspace"]


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True, scope="module")
def _no_stray_namespaces():
    yield
    if os.geteuid() == 0:
        assert f"kvc-{os.getpid()}-" not in netns_list()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rate_mbit, megabytes", [(50, 10), (200, 20)])
def test_measured_rate_is_the_set_rate(mode, rate_mbit, megabytes):
    with open_link(rate_mbit, mode=mode) as link, byte_source(link) as port:
        assert link.kind == mode
        m = measure(*link.expose(port), int(megabytes * 1e6))
    assert 0.6 * rate_mbit <= m["mbit_s"] <= 1.15 * rate_mbit, m


@pytest.mark.parametrize("mode", MODES)
def test_delay_adds_latency(mode):
    delay_ms = 10.0
    with open_link(100, delay_ms, mode=mode) as link, byte_source(link) as port:
        m = measure(*link.expose(port), 1_000_000)
        assert link.describe()["delay_ms"] == delay_ms
    assert m["rtt_ms"] >= 2 * delay_ms * 0.95, m  # delay_ms each way
    assert m["rtt_ms"] < 2 * delay_ms + 15, m


@needs_root
def test_netns_teardown_removes_namespace_and_its_servers():
    link = open_link(100, mode="netns")
    server = subprocess.Popen(link.wrap([sys.executable, "-c", "import time; time.sleep(60)"]))
    ns = link.netns
    assert ns in netns_list() and link.server_host.startswith("10.77.")
    assert link.expose(8080) == (link.server_host, 8080)
    link.down()
    server.wait(timeout=10)  # stopped by PID with the namespace
    assert ns not in netns_list()
    assert subprocess.run(["ip", "link", "show", link.veth[0]], capture_output=True).returncode != 0
    link.down()  # idempotent


@pytest.mark.parametrize("mode", MODES)
def test_teardown_stops_proxies(mode):
    with open_link(100, 5.0, mode=mode) as link, byte_source(link) as port:
        link.expose(port)
        pids = link.proxy_pids()
        assert pids and all(alive(p) for p in pids)  # userspace shaper, or netns delay relay without netem
    assert not any(alive(p) for p in pids)


@needs_root
def test_auto_takes_netns_as_root():
    with open_link(100) as link:
        assert link.kind == "netns"


def test_cli_up_down_and_run(capsys, tmp_path):
    name = f"kvc-t{os.getpid()}"
    assert main(["up", "--rate-mbit", "100", "--delay-ms", "2", "--mode", "userspace",
                 "--name", name, "--expose", "9"]) == 0
    up = json.loads(capsys.readouterr().out)
    assert up["kind"] == "userspace" and up["name"] == name
    [pid] = up["proxy_pids"]
    assert alive(pid)  # left up after main() returned
    assert main(["down", "--name", name]) == 0
    capsys.readouterr()
    assert not alive(pid)

    out = tmp_path / "env.json"
    code = ("import json,os,sys; json.dump({k: v for k, v in os.environ.items() if k.startswith('KVCODEC_LINK')},"
            " open(sys.argv[1], 'w')); sys.exit(3)")
    assert main(["run", "--rate-mbit", "50", "--", sys.executable, "-c", code, str(out)]) == 3
    env = json.loads(out.read_text())
    assert env["KVCODEC_LINK_RATE_MBIT"] == "50.0" and env["KVCODEC_LINK_SERVER_HOST"]
    if env["KVCODEC_LINK_KIND"] == "netns":
        assert env["KVCODEC_LINK_WRAP"] == f"ip netns exec {env['KVCODEC_LINK_NETNS']}"
        assert env["KVCODEC_LINK_NETNS"] not in netns_list()
