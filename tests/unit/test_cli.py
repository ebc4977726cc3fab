"""The ``kvcodec`` command line: a thin dispatcher whose commands take ``--engine``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcodec_tools.cli import build_parser

KVCODEC = str(Path(sys.executable).parent / "kvcodec")


@pytest.mark.parametrize("command", [["serve"], ["ingest", "--text-file", "f"], ["eval", "--text-file", "f"],
                                     ["demo"], ["generate", "--text-file", "f"], ["rd"], ["bench", "ttft"]])
def test_every_command_takes_an_engine(command):
    args = build_parser().parse_args(command + ["--engine", "transformers"])
    assert args.engine == "transformers"


def test_serve_help_lists_engine_and_ladder():
    proc = subprocess.run([KVCODEC, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--engine" in proc.stdout and "--ladder" in proc.stdout


def test_serve_keeps_codecs_as_the_ladders_old_flag():
    assert build_parser().parse_args(["serve", "--codecs", "raw,video"]).ladder == "raw,video"


def test_ingest_defaults_to_the_servers_ladder():
    assert build_parser().parse_args(["ingest", "--text-file", "f"]).codec is None


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
    proc = subprocess.run([KVCODEC, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "serve" in proc.stdout and "bench" in proc.stdout
