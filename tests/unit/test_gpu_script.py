"""The prepared GPU run (``tests/gpu/run.sh``) without a GPU and without its download: the manifest
builder and its check, the 64 MiB size check on a small fake carried folder, the runner's report
(a check that passes, fails, hangs or dies), the run call, the tiny model's recipe and the torch
restore against the library's. The wheel itself is checked only when a dry run fetched it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcodec.encode import ChunkEncoder
from kvcodec.format.codecs import SCHEMES
from kvcodec.format.keys import chunk_keys
from kvcodec.serving.restore import restore
from tests.gpu import carry, gpu_checks, tiny_model
from tests.unit.conftest import on_tiny_profile, structured_kv, synthetic_kv

MODEL = "unit-gpu-script@test"
RUN_SH = Path(__file__).resolve().parents[1] / "gpu" / "run.sh"


def _chunk(rung: str, kv: np.ndarray, index: int = 0, tokens: int = 256) -> bytes:
    scheme = SCHEMES[rung].with_kv_dtype("float32")
    if scheme.needs_profile:
        scheme = on_tiny_profile(scheme)
    key = chunk_keys(list(range((index + 1) * tokens)), MODEL, scheme.identity, tokens)[index]
    return ChunkEncoder(scheme, MODEL, auth=carry.auth()).encode(kv, key, index, index * tokens)


def _manifest(folder: Path, entries) -> dict:
    (folder / carry.MODEL_ARCHIVE).write_bytes(b"model")
    model = {"file": carry.MODEL_ARCHIVE, "bytes": 5, "sha256": carry.sha256(folder / carry.MODEL_ARCHIVE)}
    return {"format": carry.FORMAT, "model": model, "wheels": [], "chunks": entries}


def test_manifest_entries_describe_the_chunks_and_verify_finds_what_changed(tmp_path):
    kv = synthetic_kv(1)
    entries = carry.write_chunks(tmp_path, [("raw", 0, _chunk("raw", kv)), ("lossless8", 0, _chunk("lossless8", kv))],
                                 carry.auth())
    raw, q8 = entries
    assert raw["file"] == "chunks/raw/0000.kvc" and (tmp_path / raw["file"]).is_file()
    assert q8["geometry"] == {"layers": 4, "kv_heads": 3, "head_dim": 64, "tokens": 256}
    assert q8["planes_shape"] == [8, 256, 192] and q8["planes_dtype"] == "uint8" and len(q8["frames"]) == 8
    assert q8["fp16_bytes"] == kv.size * 2 and q8["model_id"] == MODEL
    manifest = _manifest(tmp_path, entries)
    (tmp_path / carry.MANIFEST).write_text(json.dumps(manifest))
    assert carry.load_manifest(tmp_path) == manifest
    assert carry.verify(tmp_path, manifest) == []

    wrong = json.loads(json.dumps(manifest))
    wrong["chunks"][1]["planes_digest"] = "0" * 32
    wrong["chunks"][1]["frames"][3]["sum"] += 1
    assert any("planes_digest differs" in p for p in carry.verify(tmp_path, wrong, decoder=None))
    assert any("decoded planes differ" in p for p in carry.verify(tmp_path, wrong))

    path = tmp_path / q8["file"]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # in the payload
    path.write_bytes(bytes(data))
    problems = carry.verify(tmp_path, manifest)
    assert any("SHA-256 differs" in p for p in problems) and any("CorruptChunk" in p for p in problems)


def test_a_manifest_of_another_format_is_refused(tmp_path):
    with pytest.raises(carry.CarryError, match="missing"):
        carry.load_manifest(tmp_path)
    (tmp_path / carry.MANIFEST).write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(carry.CarryError, match="format"):
        carry.load_manifest(tmp_path)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_sizes_count_the_tree_and_the_carried_folder_once(tmp_path):
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("ignored.bin\n")
    (repo / "src" / "tracked.py").write_bytes(b"x" * 1000)
    _git(repo, "add", ".gitignore", "src/tracked.py")
    (repo / "untracked.txt").write_bytes(b"y" * 500)  # travels: untracked, not ignored
    (repo / "ignored.bin").write_bytes(b"z" * 10_000)  # stays
    fake = repo / ".gpu-carry"  # not ignored here: counted once, as the carried folder
    (fake / "wheels").mkdir(parents=True)
    (fake / "wheels" / "w.whl").write_bytes(b"w" * 3000)
    (fake / "manifest.json").write_bytes(b"{}")
    tree = 1000 + 500 + len("ignored.bin\n")

    report = carry.sizes(repo, fake, limit=6000, warn=4000)
    assert (report["tree_bytes"], report["carry_bytes"]) == (tree, 3002)
    assert report["carry"] == {"wheels": 3000, "manifest.json": 2}
    assert report["total_bytes"] == tree + 3002 and report["ok"] and report["warning"]
    carry.check_sizes(report)
    over = carry.sizes(repo, fake, limit=4000)
    assert not over["ok"]
    with pytest.raises(carry.CarryError, match="over"):
        carry.check_sizes(over)


def _child(code: str) -> list:
    return [sys.executable, "-c", code]


def test_each_check_runs_in_its_own_process_and_any_end_is_reported(tmp_path):
    result = tmp_path / "r.json"
    write = "import json,sys; json.dump({d}, open(sys.argv[1], 'w'))"
    ok = gpu_checks.run_isolated(_child(write.format(d="{'ok': True, 'complete': True, 'result': {'x': 1}}"))
                                 + [str(result)], 30, result)
    assert ok["ok"] and ok["result"] == {"x": 1} and ok["error"] is None and ok["budget_s"] == 30

    hung = gpu_checks.run_isolated(_child("import time; time.sleep(30)"), 1, result)
    assert not hung["ok"] and "timed out after its budget of 1 s" in hung["error"]

    died = _child(write.format(d="{'ok': False, 'complete': False, 'result': {'rung': 'a'}}")
                  + "; import os, signal; os.kill(os.getpid(), signal.SIGKILL)") + [str(result)]
    crashed = gpu_checks.run_isolated(died, 30, result)
    assert not crashed["ok"] and "signal 9" in crashed["error"] and crashed["result"] == {"rung": "a"}

    silent = gpu_checks.run_isolated(_child("raise SystemExit(3)"), 30, result)
    assert not silent["ok"] and "exit status 3" in silent["error"]

    rep = gpu_checks.report({"env": ok, "engine": crashed}, dry_run=True, started=0.0, manifest_sha256="m",
                            decoder="pyav", device="cpu")
    assert rep["schema"] == gpu_checks.SCHEMA and rep["dry_run"] is True
    assert rep["ok"] is False and rep["failed"] == ["engine"] and set(rep["checks"]) == {"env", "engine"}
    json.dumps(rep)


def test_the_runner_writes_the_report_and_exits_non_zero_when_a_check_fails(tmp_path):
    out = tmp_path / "gpu_checks.json"
    rc = gpu_checks.main(["--carry", str(tmp_path / "nothing"), "--json", str(out), "--only", "env", "--dry-run"])
    rep = json.loads(out.read_text())
    assert rc == 1 and rep["failed"] == ["env"] and rep["ok"] is False
    assert "manifest.json is missing" in rep["checks"]["env"]["error"]
    assert set(rep) >= {"schema", "dry_run", "decoder", "device", "ok", "failed", "wall_s", "checks", "budgets_s"}


def test_the_run_call_and_the_time_limits_fit_the_device():
    call = carry.run_call()
    assert call == {"command": "bash tests/gpu/run.sh", "carry": [".gpu-carry"], "timeout_s": carry.RUN_TIMEOUT_S}
    assert carry.run_call("other")["command"].startswith("GPU_CARRY=other ")
    limit_s = int(re.search(r"^LIMIT_S=(\d+)", RUN_SH.read_text(), re.M).group(1))
    assert sum(gpu_checks.BUDGETS.values()) + 30 < limit_s < carry.RUN_TIMEOUT_S <= 600
    assert limit_s < 8 * 60  # the whole run ends within 8 minutes
    args = carry.pip_download_args(Path("d"))
    assert args[-1] == carry.WHEEL_SPEC and "--no-deps" in args and args[args.index("--python-version") + 1] == "3.12"
    assert all(p in args for p in carry.PLATFORMS)


def test_the_carried_wheel_is_the_pinned_one():
    path = carry.REPO / carry.CARRY / "wheels" / carry.WHEEL
    if not path.is_file():
        pytest.skip(f"no {path.name} here: `bash tests/gpu/run.sh --dry-run` downloads it (needs the network)")
    assert carry.sha256(path) == carry.WHEEL_SHA256


def test_the_tiny_model_has_the_smollm2_kv_geometry_and_fixed_weights():
    from kvcodec.engines.model_files import check_config
    from kvcodec.profiles import load_profile

    check_config(tiny_model.CONFIG)  # the card's shape: 30 layers, 3 KV heads, 64 dims, 49152 tokens
    c = tiny_model.CONFIG
    assert load_profile("smollm2-135m-v1").fits(c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"])
    assert load_profile("smollm2-135m-v1").rope_theta == c["rope_parameters"]["rope_theta"]
    a, b = tiny_model.weights(), tiny_model.weights()
    assert a.keys() == b.keys() and len(a) == 2 + 9 * 30
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert a[name].dtype == np.float16 and np.array_equal(a[name], b[name])
    assert a["model.embed_tokens.weight"].shape == (49152, 192)
    assert a["model.layers.0.self_attn.q_proj.weight"].shape == (192, 192)


@pytest.mark.parametrize("rung", ["lossless8", "video"])
def test_torch_restore_equals_the_library_restore(tiny_profile, tmp_path, rung):
    from tests.gpu.torch_restore import planes_to_device, planes_to_host, restore_torch

    kv = structured_kv(3, token_start=256) if rung == "video" else synthetic_kv(3)
    entry = carry.write_chunks(tmp_path, [(rung, 1, _chunk(rung, kv, index=1))], carry.auth())[0]
    decoded = gpu_checks.decode_entry(tmp_path, entry, "pyav")
    want = restore(decoded)
    planes = planes_to_device(decoded.planes, "cpu")
    assert np.array_equal(planes_to_host(planes), decoded.planes)
    got = restore_torch(decoded.header, planes, decoded.side).numpy()
    assert got.dtype == np.float16 and got.shape == want.shape
    assert np.abs(got.astype(np.float32) - want.astype(np.float32)).max() <= 2e-3 * np.abs(want).max()


# -- the stage call (nvCOMP's wheels and the entropy chunks) and the checks that read it ---------------
def _stage(folder: Path, tiny_profile) -> dict:
    from dataclasses import replace

    kv = structured_kv(4)
    chunks = []
    for label, (rung, params) in carry.ENTROPY.items():
        scheme = replace(on_tiny_profile(SCHEMES[rung]), codec_params=dict(SCHEMES[rung].codec_params, **params))
        key = chunk_keys(list(range(256)), MODEL, scheme.identity, 256)[0]
        chunks.append((label, 0, ChunkEncoder(scheme, MODEL, auth=carry.auth()).encode(kv, key, 0, 0)))
    manifest = {"format": carry.STAGE_FORMAT, "model_id": MODEL, "wheels": [],
                "chunks": carry.write_chunks(folder, chunks, carry.auth())}
    (folder / carry.MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_the_nvcomp_check_decodes_every_staged_chunk_bit_exactly_in_its_cpu_part(tmp_path, tiny_profile):
    manifest = _stage(tmp_path, tiny_profile)
    assert {e["rung"] for e in manifest["chunks"]} == set(carry.ENTROPY)
    framed = [e for e in manifest["chunks"] if e["rung"].endswith("-f64")]
    assert framed and all('"frame_kb":64' in e["scheme_id"] for e in framed)
    ctx = gpu_checks.Ctx(tmp_path, {}, dry_run=True, stage=tmp_path)
    ok, out = gpu_checks.check_nvcomp(ctx)
    assert ok, out
    assert out["decoder"] == "cpu" and all(out[label]["bit_exact"] for label in carry.ENTROPY)
    assert out["int8-zstd-f64"]["zstd_frames"] > 1 == out["int8-zstd"]["zstd_frames"]
    assert all(out[label]["fp16_GBps"] > 0 for label in carry.ENTROPY)
    damaged = tmp_path / manifest["chunks"][0]["file"]
    data = bytearray(damaged.read_bytes())
    data[-50] ^= 0xFF
    damaged.write_bytes(bytes(data))
    ok, out = gpu_checks.check_nvcomp(ctx)
    assert not ok and out["carry_problems"] and "error" in out[manifest["chunks"][0]["rung"]]


def test_without_the_stage_call_the_nvcomp_check_says_to_make_it(tmp_path):
    ctx = gpu_checks.Ctx(tmp_path, {}, dry_run=False, stage=tmp_path / "not-carried")
    with pytest.raises(carry.CarryError, match="carry it with the stage call first"):
        gpu_checks.check_nvcomp(ctx)


def test_the_device_calls_stage_first_then_run_the_checks_each_within_its_limit():
    stage, triton, checks = carry.run_calls()
    assert stage == {"command": "bash tests/gpu/run.sh --stage", "carry": [carry.STAGE],
                     "timeout_s": carry.STAGE_TIMEOUT_S}
    assert triton == {"command": "bash tests/gpu/run.sh --stage-triton", "carry": [carry.TRITON_STAGE],
                      "timeout_s": carry.TRITON_TIMEOUT_S}
    assert checks == carry.run_call() and checks["carry"] == [carry.CARRY]
    assert all(len(c["command"]) <= 2000 and c["timeout_s"] <= 600 for c in (stage, triton, checks))
    other = carry.run_calls("c2", "s2")
    assert other[0]["command"].startswith("GPU_STAGE=s2 ") and other[2]["command"].startswith("GPU_STAGE=s2 GPU_CARRY=c2 ")
    assert "nvcomp" in gpu_checks.BUDGETS and max(gpu_checks.CONCURRENCY) == 7
    text = RUN_SH.read_text()
    assert '--stage)' not in text and '"--stage" ]' in text  # run.sh takes the stage call's flag
    assert f"/{carry.STAGE}/" in (carry.REPO / ".gitignore").read_text()  # never counted in the tree


def test_the_nvcomp_wheels_are_the_pinned_ones():
    folder = carry.REPO / carry.STAGE / "wheels"
    if not folder.is_dir():
        pytest.skip(f"no {folder}: `bash tests/gpu/run.sh --dry-run` downloads them (needs the network)")
    assert {p.name: carry.sha256(p) for p in folder.iterdir()} == carry.NVCOMP_WHEELS


def test_nvcomp_in_the_site_folder_imports_beside_a_regular_nvidia_package(tmp_path, monkeypatch):
    """On a machine whose torch brings an ``nvidia`` package with an ``__init__.py``, nvCOMP's
    namespace folder in the wheels' site would be hidden; the shim makes both import."""
    site, system = tmp_path / "site", tmp_path / "system"
    (site / "nvidia" / "nvcomp").mkdir(parents=True)
    (site / "nvidia" / "nvcomp" / "__init__.py").write_text("WHERE = 'site'\n")
    (system / "nvidia" / "cublas").mkdir(parents=True)
    (system / "nvidia" / "__init__.py").write_text("")
    (system / "nvidia" / "cublas" / "__init__.py").write_text("WHERE = 'system'\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}:{system}")
    probe = [sys.executable, "-c", "import nvidia.nvcomp, nvidia.cublas; print(nvidia.nvcomp.WHERE, nvidia.cublas.WHERE)"]
    assert subprocess.run(probe, capture_output=True).returncode != 0  # hidden, as it would be there
    assert "imports with a pkgutil" in carry.nvidia_namespace(site)
    assert subprocess.run(probe, capture_output=True, text=True).stdout.split() == ["site", "system"]
    assert carry.nvidia_namespace(site) == "nvidia.nvcomp imports"  # a second run leaves it as it is


def test_the_trtllm_checks_are_prepared_and_their_plan_runs_without_tensorrt_llm(tmp_path):
    """``run.sh --trtllm`` (inside NVIDIA's TensorRT-LLM container; never run: no TensorRT-LLM here nor
    on the lent GPU machine): the script parses, names the four first checks of issue 46, refuses to
    start without TensorRT-LLM, and its dry run (also part of ``run.sh --dry-run``) builds each check's
    LLM() arguments with the connector and the GPU memory share."""
    from tests.gpu import trtllm_checks

    text = RUN_SH.read_text()
    assert subprocess.run(["bash", "-n", str(RUN_SH)], capture_output=True).returncode == 0
    assert '"--trtllm" ]' in text and "tests.gpu.trtllm_checks --dry-run" in text
    assert trtllm_checks.CHECKS == ("restore", "concurrent", "failed_load", "memory")
    assert set(trtllm_checks.RUNNERS) == set(trtllm_checks.CHECKS)
    env = dict(__import__("os").environ, PYTHON=sys.executable, OUT=str(tmp_path))
    refused = subprocess.run(["bash", str(RUN_SH), "--trtllm", "model"], capture_output=True, text=True, env=env,
                             timeout=60)
    assert refused.returncode == 2 and "tensorrt_llm" in refused.stdout
    report = tmp_path / "plan.json"
    assert trtllm_checks.main(["--dry-run", "--json", str(report)]) == 0
    plan = json.loads(report.read_text())["checks"]
    assert set(plan) == set(trtllm_checks.CHECKS) and plan["concurrent"]["prefetch"] is True
    assert all("kv_connector_config" in c["args"] and c["kv_fraction"] == 0.6 for c in plan.values())
    assert trtllm_checks.main(["--only", "restore"]) == 2  # no TensorRT-LLM: says what it needs
