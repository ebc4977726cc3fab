"""``kvcodec soak``'s pure parts: the growth between the first and the last window, the flatness
rule, the process-tree footprint (against this test process and a child and grandchild it starts),
the shared-memory accounting (on a temporary folder standing for /dev/shm), the request plan, the
TTFT table and the plot. No server."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvcodec.settings import Settings
from kvcodec_tools.cli import _settings, build_parser
from kvcodec_tools.procstats import ProcInfo, descendants, read_proc, sample_tree, shm_matching, shm_usage, stub_regions
from kvcodec_tools.soak import (
    MODES,
    RSS_GROWTH_LIMIT,
    Outcome,
    SoakConfig,
    flatness,
    growth,
    plan,
    plot,
    soak_config,
    summarize,
    ttft_table,
    windows,
)
from kvcodec_tools.tritonserver import Ports, TritonServer

MiB = 2**20
REPO = Path(__file__).resolve().parents[2]


def samples(rss, fds=10, processes=5, shm=4 * MiB, every_s=5.0, **extra):
    """One sample per value of ``rss`` (a list), ``every_s`` apart; other keys constant or lists."""
    def at(v, i):
        return v[i] if isinstance(v, list) else v
    return [{"t_s": i * every_s, "rss_bytes": r, "fds": at(fds, i), "processes": at(processes, i),
             "shm_bytes": at(shm, i), **extra} for i, r in enumerate(rss)]


# -- growth and flatness -------------------------------------------------------------------------
def test_windows_skip_the_warmup_and_do_not_overlap():
    s = samples([0] * 21)  # t = 0..100 s
    first, last = windows(s, warmup_s=30, window_s=60)
    assert [x["t_s"] for x in first] == [30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85]
    assert [x["t_s"] for x in last] == [90, 95, 100]  # the last minute, but not before the first window ends
    assert windows([], 30, 60) == ([], [])


def test_growth_is_last_median_minus_first_median():
    # warm-up from 100 to 200 MiB is ignored; then flat at 200 with one spike; last minute 205
    rss = [100 * MiB] * 6 + [200 * MiB] * 12 + [205 * MiB] * 12
    rss[10] = 900 * MiB  # a spike inside the first window: the median ignores it
    grown, base = growth(samples(rss), warmup_s=30, window_s=60)
    assert base["rss_bytes"] == 200 * MiB
    assert grown["rss_bytes"] == 5 * MiB
    assert grown["fds"] == 0 and grown["processes"] == 0 and grown["shm_bytes"] == 0


def test_growth_is_none_when_the_run_is_too_short():
    grown, base = growth(samples([1] * 5), warmup_s=30, window_s=60)  # 20 s of samples
    assert all(v is None for v in grown.values()) and all(v is None for v in base.values())
    flat, why = flatness(grown, base)
    assert not flat and "too short" in why[0]


@pytest.mark.parametrize("rss_growth, fds, processes, shm, flat", [
    (0.0, 0, 0, 0, True),
    (0.049, 0, 0, 0, True),
    (RSS_GROWTH_LIMIT, 0, 0, 0, False),  # 5% is too much
    (-0.2, -3, -1, 0, True),  # shrinking is no leak
    (0.0, 1, 0, 0, False),
    (0.0, 0, 1, 0, False),
    (0.0, 0, 0, 4096, False),
    (0.0, 0.5, 0, 0, False),  # a median between two counts
])
def test_flatness_rule(rss_growth, fds, processes, shm, flat):
    base = {"rss_bytes": 1000 * MiB, "fds": 80, "processes": 5, "shm_bytes": 8 * MiB}
    grown = {"rss_bytes": rss_growth * 1000 * MiB, "fds": fds, "processes": processes, "shm_bytes": shm}
    got, why = flatness(grown, base)
    assert got is flat
    assert bool(why) is not flat


def test_summary_flags_errors_growth_and_percentiles():
    config = SoakConfig(clients=2, duration_s=100, warmup_s=10, window_s=20, sample_s=5)
    s = samples([100 * MiB] * 21, fds=[80] * 18 + [81] * 3)
    outs = [Outcome(0, "grpc", 0, "raw", 1.0, ttft_s=0.1 * (i + 1), total_s=1.0) for i in range(10)]
    outs += [Outcome(1, "http", 1, "prefill", 2.0, ttft_s=1.0, total_s=2.0),
             Outcome(1, "http", 0, "int8-zstd", 3.0, error="wrong answer: [1] != alone [2]")]
    doc = summarize(config, outs, s, wall_s=100.0)
    assert doc["requests"] == 12 and doc["requests_per_s"] == 0.12
    assert doc["errors"] == 1 and doc["wrong_answers"] == 1 and "int8-zstd" in doc["error_messages"][0]
    assert doc["growth"]["fds"] == 1 and not doc["flat"] and doc["not_flat"] == ["fds grew by 1"]
    assert doc["ttft"]["grpc"]["raw"] == {"requests": 10, "p50_s": 0.55, "p90_s": 0.91, "p99_s": 0.991}
    assert doc["ttft"]["http"]["prefill"]["requests"] == 1 and "int8-zstd" not in doc["ttft"]["http"]
    assert doc["by_protocol"] == {"grpc": 10, "http": 2}


def test_ttft_table_leaves_out_failures():
    assert ttft_table([Outcome(0, "grpc", 0, "raw", 1.0, error="ClientError: boom")]) == {}


# -- the plan ------------------------------------------------------------------------------------
def test_plan_covers_every_prompt_in_every_mode():
    pairs = plan(0, 3, 9)
    assert sorted(pairs) == sorted((p, m) for p in range(3) for m in MODES)
    assert plan(1, 3, 2) == plan(0, 3, 3)[1:]  # each client starts one pair on
    assert {m for _, m in plan(5, 2, 6)} == set(MODES)  # reuse on and off mixed


def test_config_checks_its_values():
    assert SoakConfig().protocols == ("grpc", "http") and SoakConfig().clients == 8
    with pytest.raises(ValueError, match="protocols"):
        SoakConfig(protocols=("grpc", "udp"))
    with pytest.raises(ValueError):
        SoakConfig(clients=0)


def test_the_command_runs_the_soak_its_flags_describe(tmp_path):
    """What ``kvcodec soak`` hands to ``run_soak``: the config its flags build (its defaults are the
    library's) and the settings whose engine the server it starts is given."""
    parse = build_parser().parse_args
    assert soak_config(parse(["soak"])) == SoakConfig()
    config = soak_config(parse(["soak", "--clients", "3", "--protocols", "http", "--duration-s", "20",
                                "--max-tokens", "4", "--threads", "1", "--warmup-s", "5"]))
    assert (config.clients, config.protocols, config.duration_s, config.max_tokens, config.threads,
            config.warmup_s) == (3, ("http",), 20.0, 4, 1, 5.0)
    with pytest.raises(SystemExit, match="^kvcodec soak: protocols must be grpc and/or http, got grpc,udp$"):
        soak_config(parse(["soak", "--protocols", "grpc,udp"]))
    settings = _settings(parse(["soak", "--engine", "vllm", "--home", str(tmp_path)]))
    env = TritonServer(REPO / "model_repository", settings, Ports()).environment()
    assert env["KVCODEC_ENGINE"] == "vllm" and Settings.load(env=env).engine == "vllm"  # what llm loads


# -- the process tree ----------------------------------------------------------------------------
@pytest.fixture
def family():
    """A child (sh) of this process that started a grandchild (sleep), in their own group; both
    stopped by that group's id (our child's pid) at the end."""
    child = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                             start_new_session=True)
    grandchild = int(child.stdout.readline())
    deadline = time.monotonic() + 10
    while (read_proc(grandchild).argv[:1] != ["sleep"]) and time.monotonic() < deadline:
        time.sleep(0.01)  # forked, not yet exec'd
    yield child.pid, grandchild
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(10)
    child.stdout.close()


def test_descendants_include_children_and_grandchildren(family):
    child, grandchild = family
    below = descendants(os.getpid())
    assert child in below and grandchild in below
    assert descendants(child) == [grandchild]
    assert descendants(grandchild) == []


def test_sample_tree_counts_the_whole_family(family):
    child, grandchild = family
    me = read_proc(os.getpid())
    assert me.state in "RS" and me.rss_bytes > 10 * MiB and me.fds >= 3 and me.threads >= 1
    assert read_proc(grandchild).argv == ["sleep", "60"]
    alone = sample_tree(grandchild)
    assert alone["processes"] == 1 and alone["zombies"] == 0 and alone["fds"] >= 1
    tree = sample_tree(os.getpid())
    assert tree["processes"] >= 3 and tree["rss_bytes"] > me.rss_bytes
    assert tree["fds"] >= me.fds + alone["fds"] and tree["threads"] >= me.threads + 2


def test_a_zombie_is_counted_apart_and_a_gone_process_is_none(family):
    child, grandchild = family
    os.kill(grandchild, signal.SIGKILL)  # sh reaps it; then kill sh and do not reap it: a zombie
    deadline = time.monotonic() + 10
    while read_proc(grandchild) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert read_proc(grandchild) is None
    os.kill(child, signal.SIGKILL)
    while read_proc(child).state != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert read_proc(child).state == "Z"
    here = sample_tree(child)
    assert here["processes"] == 0 and here["zombies"] == 1 and here["fds"] == 0


# -- shared memory -------------------------------------------------------------------------------
def stub_argv(region, instance):
    return ["/x/triton_python_backend_stub", f"/repo/{instance[:-4]}/1/model.py", region, "1048576", "1048576",
            "123", "/x", "336", instance, "DEFAULT"]


def test_stub_regions_come_from_live_stub_command_lines():
    procs = [ProcInfo(1, "S", 0, 1, 4, ["tritonserver", "--model-repository=/r"]),
             ProcInfo(2, "S", 0, 1, 4, stub_argv("triton_python_backend_shm_region_a", "kv_decode_0_0")),
             ProcInfo(3, "Z", 0, 1, 0, stub_argv("triton_python_backend_shm_region_b", "kv_fetch_0_0")),
             ProcInfo(4, "S", 0, 1, 4, ["python", "triton_python_backend_stub"])]
    assert stub_regions(procs) == {"kv_decode_0_0": "triton_python_backend_shm_region_a"}


def test_shm_usage_on_a_folder(tmp_path):
    a, b = tmp_path / "triton_python_backend_shm_region_a", tmp_path / "triton_python_backend_shm_region_b"
    a.write_bytes(b"\1" * 8192)  # written: allocated
    with open(b, "wb") as f:
        f.truncate(MiB)  # grown, untouched: sparse
    (tmp_path / "someone_else").write_bytes(b"x" * 100)
    size, allocated, files = shm_usage([a.name, b.name, "triton_python_backend_shm_region_gone"], tmp_path)
    assert (size, files) == (8192 + MiB, 2)
    assert 8192 <= allocated < MiB
    assert shm_usage([a.name, a.name], tmp_path)[0] == 8192  # a region named twice counts once
    assert shm_matching("triton_python_backend", tmp_path) == [a.name, b.name]
    assert shm_matching("x", tmp_path / "missing") == []


def test_plot_writes_a_png(tmp_path):
    config = SoakConfig(duration_s=100, warmup_s=10, window_s=20)
    plot(samples([100 * MiB + i for i in range(21)]), tmp_path / "r.png", config)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
