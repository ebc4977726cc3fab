"""The ``kvcodec`` command line: what its flags do (through the functions the commands call: the
settings they build, the server environment those give, a real ingest), its help, and the one line
it says, at once and without a traceback, for a wrong venv or a missing service (the real
``kvcodec`` script, in a subprocess)."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcodec.settings import Settings
from kvcodec_tools import cli, tritonserver
from kvcodec_tools.cli import build_parser
from kvcodec_tools.ports import free_ports
from kvcodec_tools.tritonserver import Ports, TritonServer

pytestmark = pytest.mark.timeout(300)

KVCODEC = str(Path(sys.executable).parent / "kvcodec")
REPO = Path(__file__).resolve().parents[2]
MODEL_CACHE = str(REPO / ".cache" / "models")
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def run_kvcodec(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([KVCODEC, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def one_line_refusal(proc: subprocess.CompletedProcess, command: str) -> str:
    """The refusal a user sees: a non-zero exit, one line on stderr naming the command, no traceback."""
    assert proc.returncode != 0, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvcodec {command}: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


# -- what the flags do ---------------------------------------------------------------------------
def test_serve_keeps_codecs_as_the_ladders_old_flag(tmp_path):
    """``serve --codecs`` (an alias of ``--ladder``) sets the ladder that the server's steps read: the settings
    ``serve`` builds carry it into the server's environment, where each step loads its settings."""
    for flag in ("--codecs", "--ladder"):
        args = build_parser().parse_args(["serve", flag, "raw,int8-zstd", "--home", str(tmp_path)])
        env = TritonServer(REPO / "model_repository", cli._settings(args), Ports()).environment()
        assert env["KVCODEC_LADDER"] == "raw,int8-zstd"
        assert Settings.load(env=env).ladder == ("raw", "int8-zstd")  # what kv_fetch's initialize reads
    default = cli._settings(build_parser().parse_args(["serve", "--home", str(tmp_path)]))
    assert default.ladder != ("raw", "int8-zstd")


def test_ingest_defaults_to_the_servers_ladder(tmp_path):
    """Without ``--codec``, ``kvcodec ingest`` stores the chunks at every rung of the ladder a server
    started from the same environment fetches from (``KVCODEC_LADDER``), and only those."""
    text = tmp_path / "context.txt"
    text.write_text((REPO / "perf" / "kvcodec_tools" / "demo.py").read_text())
    store = tmp_path / "store"
    proc = run_kvcodec("ingest", "--home", str(tmp_path / "home"), "--store", f"file://{store}", "--model-cache",
                       MODEL_CACHE, "--threads", "1", "--text-file", str(text), "--json", "--quiet",
                       env={"KVCODEC_LADDER": "raw,int8-zstd"}, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert set(doc["rungs"]) == {"raw", "int8-zstd"}
    assert all(r["written"] == doc["chunks"] > 0 for r in doc["rungs"].values())
    assert len(list(store.rglob("*.kvc"))) == 2 * doc["chunks"]


ENGINE_COMMANDS = [["serve"], ["ingest", "--text-file", "f"], ["eval", "--text-file", "f"], ["demo"], ["rd"],
                   ["eval-task"], ["bench", "ttft"], ["bench", "concurrency"], ["soak"], ["profile", "fit"]]


@pytest.mark.skipif(HAS_VLLM, reason="this venv has vLLM: no command refuses --engine vllm")
@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: "-".join(c[:2]).replace("--text-file", "").strip("-"))
def test_every_command_takes_an_engine(command, capsys):
    """``--engine`` picks the engine each command loads: ``--engine vllm`` in a venv without vLLM is
    refused before anything starts, naming the venv that runs it; ``--engine transformers`` is not."""
    assert cli.main([*command, "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the vllm engine needs vllm" in err and ".venv-vllm/bin/kvcodec" in err
    assert cli._engine_missing(build_parser().parse_args([*command, "--engine", "transformers"])) == ""


@pytest.mark.skipif(HAS_VLLM, reason="this venv has vLLM")
def test_generate_takes_an_engine_for_its_tokenizer_only(tmp_path):
    """``generate`` sends token ids: the vLLM engine's tokenizer needs no vLLM, so it goes on to the
    server (none here), not to the venv message."""
    text = tmp_path / "prompt.txt"
    text.write_text("def f(x):\n    return x\n")
    (port,) = free_ports(1)
    line = one_line_refusal(run_kvcodec("generate", "--engine", "vllm", "--text-file", str(text), "--url",
                                        f"127.0.0.1:{port}"), "generate")
    assert "no server at" in line


# -- a wrong venv or a missing service: one line, at once ------------------------------------------
@pytest.mark.skipif(HAS_VLLM, reason="this venv has vLLM")
def test_serve_with_the_vllm_engine_from_a_venv_without_it_names_the_vllm_venv(tmp_path):
    (port,) = free_ports(1)
    line = one_line_refusal(run_kvcodec("serve", "--engine", "vllm", "--home", str(tmp_path), "--http-port",
                                        str(port)), "serve")
    assert str(REPO / ".venv-vllm" / "bin" / "kvcodec") in line and "make setup-vllm" in line
    assert not (tmp_path / "logs").exists()  # no tritonserver was started


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_generate_without_a_server_names_the_url_and_kvcodec_serve(tmp_path, protocol):
    text = tmp_path / "prompt.txt"
    text.write_text("def f(x):\n    return x\n")
    (port,) = free_ports(1)  # free: nothing listens there
    proc = run_kvcodec("generate", "--text-file", str(text), "--protocol", protocol, "--url", f"127.0.0.1:{port}",
                       timeout=30)  # at once: not after --fallback-s (60 s) of asking again
    line = one_line_refusal(proc, "generate")
    assert f"no server at 127.0.0.1:{port}" in line and "`kvcodec serve`" in line


def test_serve_when_a_port_is_taken_says_which(tmp_path):
    http, grpc, metrics = free_ports(3)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", grpc))
        holder.listen()
        proc = run_kvcodec("serve", "--home", str(tmp_path), "--http-port", str(http), "--grpc-port", str(grpc),
                           "--metrics-port", str(metrics), timeout=60)
    line = one_line_refusal(proc, "serve")
    assert f"port {grpc} (--grpc-port) on 127.0.0.1 is in use" in line and str(http) not in line
    assert not (tmp_path / "logs").exists()  # no tritonserver was started


@pytest.mark.parametrize("scheme", ["http", "redis", "silent"])
def test_ingest_to_a_store_that_is_down_says_so_before_loading_the_model(tmp_path, scheme):
    text = tmp_path / "context.txt"
    text.write_text("def f(x):\n    return x\n" * 200)
    with socket.socket() as silent:  # "silent": a store that accepts and never answers
        silent.bind(("127.0.0.1", 0))
        if scheme == "silent":
            silent.listen()
        port = silent.getsockname()[1]  # bound and not listening: refused
        url = f"redis://127.0.0.1:{port}/0" if scheme == "redis" else f"http://127.0.0.1:{port}/kv"
        t0 = time.monotonic()
        proc = run_kvcodec("ingest", "--home", str(tmp_path), "--model-cache", MODEL_CACHE, "--store", url,
                           "--text-file", str(text), "--codec", "raw", "--quiet", timeout=60)
    line = one_line_refusal(proc, "ingest")
    assert url in line and ("timed out" if scheme == "silent" else "unreachable") in line and "--store" in line
    assert "Loading weights" not in proc.stdout + proc.stderr  # refused before the model loaded
    assert time.monotonic() - t0 < 30  # the look-up's own deadline (5 s), not the store's


def test_serve_warns_in_one_line_of_a_store_that_is_down(tmp_path):
    """``serve`` starts anyway (a store that comes back is used again); its warning is the line of
    ``_store_down``, empty for a store that answers."""
    (port,) = free_ports(1)
    args = build_parser().parse_args(["serve", "--home", str(tmp_path), "--store", f"http://127.0.0.1:{port}/kv"])
    down = cli._store_down(cli._settings(args))
    assert f"http://127.0.0.1:{port}/kv" in down and "\n" not in down
    assert cli._store_down(cli._settings(build_parser().parse_args(["serve", "--home", str(tmp_path)]))) == ""


def test_start_failure_names_each_model_that_did_not_load(tmp_path):
    """``serve``'s line for a server that did not start: the failed models from Triton's table."""
    log = tmp_path / "tritonserver.log"
    log.write_text("I1205 server.cc] \n+--------+---------+--------+\n| Model  | Version | Status |\n"
                   "| kv_fetch | 1 | READY |\n"
                   "| llm    | 1       | UNAVAILABLE: Internal: ModuleNotFoundError: No module named 'x'\\n\\nAt: |\n"
                   "|        |         |   model.py(3): <module> |\n")
    line = tritonserver._start_failure(RuntimeError("tritonserver exited (1) while starting: [...]\nmore"), log)
    assert line == (f"tritonserver did not start: model llm: UNAVAILABLE: Internal: ModuleNotFoundError: "
                    f"No module named 'x' (log {log})")
    bare = tritonserver._start_failure(RuntimeError("tritonserver exited (1)\ntail"), tmp_path / "missing.log")
    assert bare.startswith("tritonserver did not start: tritonserver exited (1) (log ")


# -- help ----------------------------------------------------------------------------------------
def test_serve_help_lists_engine_and_ladder():
    proc = run_kvcodec("serve", "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--engine" in proc.stdout and "--ladder" in proc.stdout


def _commands(parser, prefix=()):
    """Every command path of the parser: (), ("serve",), ("bench", "ttft"), ..."""
    import argparse

    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, prefix + (name,))


def test_help_works_for_the_program_and_every_command(capsys):
    """``kvcodec --help`` once crashed on a ``%`` in a help text (argparse formats help strings);
    every command's help is rendered here, the way a newcomer asks for it."""
    paths = list(_commands(build_parser()))
    assert ("bench", "ttft") in paths and ("serve",) in paths
    for path in paths:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args(list(path) + ["--help"])
        assert done.value.code == 0, path
        out = capsys.readouterr().out
        assert out.startswith("usage: kvcodec"), (path, out[:200])


def test_the_installed_kvcodec_help_exits_zero():
    proc = run_kvcodec("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "serve" in proc.stdout and "bench" in proc.stdout


@pytest.mark.parametrize("command", [["bench", "ttft"], ["bench", "concurrency"], ["bench", "load"], ["soak"], ["rd"]])
def test_a_plot_left_out_goes_beside_the_json(command, tmp_path):
    from kvcodec_tools.cli import build_parser, plot_beside_json

    args = build_parser().parse_args(command + ["--json", str(tmp_path / "x.json")])
    plot_beside_json(args)
    assert args.plot == str(tmp_path / "x.png")  # not the committed perf/results plot
    args = build_parser().parse_args(command + ["--json", str(tmp_path / "x.json"), "--plot", ""])
    plot_beside_json(args)
    assert args.plot == ""
