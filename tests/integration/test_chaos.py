"""``kvcodec soak --chaos`` for 3 minutes (the CI run; the 30-minute one is ``make chaos``): two real
tritonservers (transformers engine, each under the watchdog) behind the nginx balancer, 4 clients
over gRPC and HTTP, a real nginx store behind the misbehaving proxy, and every fault the store
allows at random, overlapping moments: nginx SIGKILLed and restarted, paused, the link trickling
and stalling, the disk under the store full (as root), a stub SIGKILLed (the watchdog restarts its
server), the HEVC decoder process SIGKILLed. Every answer equals the reference with the same reuse
(the model's own prefill, or the decoded rung's), no request is lost, no chunk in the store fails
verification, every fault heals and reuse comes back after it, and no server's process tree grows."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from .conftest import KVCODEC, REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
DURATION_S = 180


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, settings):
    out = tmp_path_factory.mktemp("chaos")
    cmd = [KVCODEC, "soak", "--chaos", "--engine", "transformers", "--home", str(out / "home"),
           "--model-cache", str(settings.model_cache), "--servers", "2", "--clients", "4",
           "--duration-s", str(DURATION_S), "--mean-gap-s", "10", "--seed", "1", "--sample-s", "3",
           "--warmup-s", "60", "--window-s", "40", "--json", str(out / "chaos.json"), "--plot", str(out / "chaos.png")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCODEC_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840, env=env, cwd=REPO)
    assert (out / "chaos.json").is_file(), \
        f"kvcodec soak --chaos wrote nothing ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((out / "chaos.json").read_text())
    print(json.dumps({k: doc[k] for k in ("requests", "wrong_answers", "lost_requests", "corrupt_chunks_stored",
                                          "over_bound", "retried_requests", "restarts", "failures")}))
    return proc, doc, out


def test_no_wrong_answer_no_lost_request_no_corrupt_chunk(chaos):
    proc, doc, _ = chaos
    assert doc["reference_failures"] == []
    assert doc["requests"] >= 40 and doc["reused_requests"] > 0
    assert doc["wrong_answers"] == 0 and doc["lost_requests"] == 0, doc["bad_answers"]
    # a reuse the references do not cover (a decoded prompt read partly from a raw copy written back
    # after a miss) is counted, never taken as right; it is rare
    assert doc["unchecked_answers"] <= max(2, doc["requests"] // 50), doc["unchecked_answers"]
    assert doc["corrupt_chunks_stored"] == 0 and doc["chunks_stored"] > 0, doc["verify_errors"]
    assert set(doc["by_kind"]) == {"reuse", "decoded", "partial", "writeback", "miss", "prefill"}
    assert all(n > 0 for n in doc["by_kind"].values()), doc["by_kind"]
    assert proc.returncode == (0 if doc["ok"] else 1), proc.stdout[-3000:]


def test_faults_overlap_heal_and_reuse_comes_back(chaos):
    _, doc, _ = chaos
    faults = doc["faults"]
    kinds = {f["kind"] for f in faults}
    assert {"store-kill", "store-pause", "trickle", "stall", "stub-kill", "decoder-kill"} <= kinds, kinds
    if os.geteuid() == 0:
        assert "disk-full" in kinds
    assert doc["faults_unhealed"] == 0 and all(f["healed_s"] is not None for f in faults), faults
    assert sum(doc["restarts"]) >= 1  # the stub kill restarted a server, under load
    # reuse came back after the faults that healed before the load's end
    back = [f for f in faults if f["reuse_back_s"] is not None]
    assert len(back) >= len(faults) - 2, faults
    spans = sorted((f["at_s"], f["healed_s"]) for f in faults)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)), "no two faults overlapped"


def test_resources_do_not_grow(chaos):
    _, doc, out = chaos
    growth = doc["resources"]["growth"]
    assert set(growth) == {"0", "1"}
    for server, g in growth.items():
        assert g["growth"]["processes"] <= 0 and g["growth"]["fds"] <= doc["resources"]["limits"]["fds"], (server, g)
        assert g["growth"]["threads"] <= doc["resources"]["limits"]["threads"], (server, g)
    series = doc["resource_series"]
    assert {s["server"] for s in series} == {0, 1}
    # a killed stub or decoder is a zombie until it is reaped or its server restarted: they never pile up
    assert max(s["zombies"] for s in series) <= 2, [s for s in series if s["zombies"] > 2][:3]
    assert (out / "chaos.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
