"""The GPU run's third carry (tritonserver), its call plan and the ensemble TTFT file: no server, no GPU."""
from __future__ import annotations

import json
import re
import tarfile
import urllib.request
from pathlib import Path

import pytest

from tests.gpu import carry, ensemble_ttft, gpu_checks, triton_carry

RUN_SH = carry.REPO / "tests" / "gpu" / "run.sh"


def test_the_three_calls_with_the_start_fit_the_device_time():
    calls = carry.run_calls()
    assert [c["carry"] for c in calls] == [[carry.STAGE], [carry.TRITON_STAGE], [carry.CARRY]]
    carry.check_plan(calls)
    assert carry.plan_seconds(calls) == carry.STARTUP_S + sum(c["timeout_s"] for c in calls) <= 15 * 60
    text = RUN_SH.read_text()
    limit = int(re.search(r"^LIMIT_S=(\d+)", text, re.M).group(1))
    ttft = int(re.search(r"^TTFT_LIMIT_S=(\d+)", text, re.M).group(1))
    assert sum(gpu_checks.BUDGETS.values()) < limit and ensemble_ttft.BUDGET_S < ttft
    assert limit + ttft + 30 < carry.RUN_TIMEOUT_S <= 600  # 30 s: the wheel installs
    assert '"--stage-triton" ]' in text


def test_a_plan_over_the_device_time_is_refused():
    calls = carry.run_calls()
    calls[2] = dict(calls[2], timeout_s=600)
    calls[1] = dict(calls[1], timeout_s=300)
    with pytest.raises(carry.CarryError, match="over the 900 s"):
        carry.check_plan(calls)
    with pytest.raises(carry.CarryError, match="limits"):
        carry.check_plan([dict(calls[0], timeout_s=601)], budget_s=10_000)


def test_sizes_refuse_an_over_limit_carry(tmp_path):
    big = tmp_path / "c"
    big.mkdir()
    (big / "blob").write_bytes(b"\0" * 4096)
    report = carry.sizes(carry.REPO, big, limit=1024)
    assert not report["ok"] and report["carry_bytes"] == 4096
    with pytest.raises(carry.CarryError, match="over"):
        carry.check_sizes(report)


def test_the_triton_carry_is_ignored_by_git():
    text = (carry.REPO / ".gitignore").read_text()
    assert f"/{triton_carry.TRITON_STAGE}/" in text and carry.TRITON_STAGE == triton_carry.TRITON_STAGE


def _fake_stage(tmp_path: Path) -> Path:
    stage = tmp_path / "stage"
    stage.mkdir()
    src = tmp_path / "bin-tritonserver"
    src.write_bytes(b"#!/bin/sh\n")
    with tarfile.open(stage / triton_carry.ARCHIVE, "w:xz") as tar:
        tar.add(src, arcname=f"{triton_carry.ROOT_IN_ARCHIVE}/bin/tritonserver")
    archive = stage / triton_carry.ARCHIVE
    manifest = {"format": triton_carry.TRITON_FORMAT, "root": triton_carry.ROOT_IN_ARCHIVE,
                "archive": {"file": triton_carry.ARCHIVE, "bytes": archive.stat().st_size,
                            "sha256": carry.sha256(archive)}, "members": {}}
    (stage / carry.MANIFEST).write_text(json.dumps(manifest))
    return stage


def test_the_triton_archive_unpacks_to_a_root_and_a_changed_one_is_refused(tmp_path):
    stage = _fake_stage(tmp_path)
    root = triton_carry.unpack(stage, tmp_path / "out")
    assert (root / "bin" / "tritonserver").stat().st_mode & 0o111
    with open(stage / triton_carry.ARCHIVE, "ab") as f:
        f.write(b"x")
    assert triton_carry.verify(stage, triton_carry.load(stage))
    with pytest.raises(carry.CarryError):
        triton_carry.unpack(stage, tmp_path / "again")


def test_the_ttft_file_has_the_gpu_fields(tmp_path):
    row = {"method": "video", "rate_gbit": 1.0, "bandwidth_mbps": 1000.0, "context_tokens": 528,
           "ttft_p50_s": 0.5, "ttft_p90_s": 0.6, "bytes_fetched": 10, "reused_tokens": 256, "tokens_match": False,
           "stage_s": {"transfer_s": 0.1, "decode_s": 0.2, "restore_s": 0.01}, "schemes": {}}
    prefill = dict(row, method="prefill", reused_tokens=0, tokens_match=True)
    data = ensemble_ttft.result_json([prefill, row], device="cuda: H200", rates_gbit=(1.0,), dry_run=False)
    path = tmp_path / "gpu_ttft.json"
    ensemble_ttft.write_json(path, data)
    back = json.loads(path.read_text())
    assert back["schema"] == ensemble_ttft.SCHEMA and back["device"] == "cuda: H200"
    assert back["rates_gbit"] == [1.0] and "tiny stand-in" in back["note"] and len(back["rows"]) == 2


def test_the_store_server_answers_gets_and_ranges(tmp_path):
    from kvcodec_tools.http_store_server import PREFIX, serve

    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "k.kvc").write_bytes(b"0123456789")
    server = serve(tmp_path)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}{PREFIX}"
        assert urllib.request.urlopen(f"{base}/ab/k.kvc").read() == b"0123456789"
        req = urllib.request.Request(f"{base}/ab/k.kvc", headers={"Range": "bytes=2-4"})
        with urllib.request.urlopen(req) as r:
            assert r.status == 206 and r.read() == b"234"
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{base}/../x.kvc")
    finally:
        server.shutdown()


def test_the_store_layout_puts_each_chunk_under_its_key(tmp_path):
    src = tmp_path / "carry"
    (src / "chunks").mkdir(parents=True)
    (src / "chunks" / "0.kvc").write_bytes(b"data")
    keys = ensemble_ttft.store_layout([{"rung": "video", "key": "m/s/abc", "file": "chunks/0.kvc"}], [src],
                                      tmp_path / "store")
    assert keys == {"video": "m/s/abc"} and (tmp_path / "store" / "m" / "s" / "abc.kvc").read_bytes() == b"data"


def test_the_preflight_names_the_stub_when_this_python_has_none(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tritonserver").write_bytes(b"")
    missing = ensemble_ttft.missing_libs(tmp_path, "")
    assert "triton_python_backend_stub (the file itself)" in missing
    assert "libtriton_python.so (the file itself)" in missing


def test_only_the_adaptive_rows_choice_to_recompute_is_no_miss():
    chose = {"method": "kvcodec", "reused_tokens": 0, "miss_reason": "chunk 0: recompute: recompute: fetching the last 1 chunk(s) would take ~0.28s"}
    assert ensemble_ttft.adaptive_recompute(chose)
    assert not ensemble_ttft.adaptive_recompute(dict(chose, method="video"))  # a static rung must reuse: its key was looked up
    assert not ensemble_ttft.adaptive_recompute(dict(chose, miss_reason="missing: no chunk under the key"))
    assert not ensemble_ttft.adaptive_recompute(dict(chose, reused_tokens=256, miss_reason=""))
