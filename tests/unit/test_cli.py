"""The ``kvcodec`` command line: a thin dispatcher whose commands take ``--engine``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcodec_client.cli import build_parser

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
