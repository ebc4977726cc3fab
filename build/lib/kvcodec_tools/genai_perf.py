"""genai-perf (NVIDIA's LLM benchmark, PyPI ``genai-perf``) against the ``kvcodec`` ensemble, through
TensorRT-LLM's interface: ``genai-perf profile -m kvcodec --backend tensorrtllm --streaming``.

- ``ensure_genai_perf() -> (binary, env)``: creates ``.venv-genai/`` (Python 3.12: genai-perf 0.0.16
  needs it; ``KVCODEC_PYTHON312``, ``python3.12`` or pyenv's 3.12) with ``genai-perf==0.0.16`` if
  missing (~45 s), and the environment to run it in: the real ``perf_analyzer`` of ``.venv-pa/``
  first on ``PATH`` (genai-perf drives it; PyPI's ``perf-analyzer`` is a placeholder);
- ``profile(binary, env, grpc_url, tokenizer_dir, out_dir, ...) -> dict``: one run of synthetic
  prompts (genai-perf sends ``text_input``, ``max_tokens``, ``stream``, ``exclude_input_in_output``),
  and what it measured: ``time_to_first_token``, ``inter_token_latency``, ``request_latency``,
  ``output_token_throughput`` and ``request_throughput`` (its ``profile_export_genai_perf.json``:
  ``avg``, ``p50``, ``p90``, ... in milliseconds for the latencies), and the command; with
  ``input_file`` (``write_prompts``: one ``{"text": ...}`` a line) its prompts instead of synthetic
  ones, so a prompt whose prefix is stored can be measured reusing it;
- ``summary(result)``: the figures a results row keeps (TTFT, ITL, request latency in ms;
  throughputs), without the command.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .perf_analyzer import ensure_perf_analyzer

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-genai"
PACKAGE = "genai-perf==0.0.16"
METRICS = ("time_to_first_token", "inter_token_latency", "request_latency", "output_token_throughput",
           "request_throughput", "output_sequence_length", "input_sequence_length")


class GenaiPerfError(RuntimeError):
    pass


def python312() -> str:
    """A Python 3.12 interpreter that runs."""
    candidates = [os.environ.get("KVCODEC_PYTHON312", ""), shutil.which("python3.12") or "",
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")), reverse=True),
                  *sorted(glob.glob("/usr/bin/python3.12"))]
    for candidate in filter(None, candidates):
        try:
            out = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                 capture_output=True, text=True, timeout=60)
        except OSError:
            continue
        if out.stdout.strip() == "True":
            return candidate
    raise GenaiPerfError("genai-perf 0.0.16 needs Python 3.12: none found (set KVCODEC_PYTHON312)")


def ensure_genai_perf(venv: Path = VENV) -> Tuple[Path, dict]:
    binary = venv / "bin" / "genai-perf"
    if not binary.exists():
        if not (venv / "bin" / "python").exists():
            subprocess.run([python312(), "-m", "venv", str(venv)], check=True, timeout=300)
        proc = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", PACKAGE], capture_output=True, text=True,
                              timeout=1200)
        if proc.returncode != 0 or not binary.exists():
            raise GenaiPerfError(f"pip install {PACKAGE} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    pa, env = ensure_perf_analyzer()
    env = dict(env, PATH=str(pa.parent) + os.pathsep + env.get("PATH", ""))
    return binary, env


def profile_args(grpc_url: str, tokenizer_dir: Path, out_dir: Path, *, input_tokens: int = 300,
                 output_tokens: int = 8, requests: int = 8, concurrency: int = 1,
                 extra_inputs: Sequence[str] = (), input_file: Optional[Path] = None) -> List[str]:
    prompts = (["--input-file", str(input_file)] if input_file is not None else
               ["--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0"])
    args = ["profile", "-m", "kvcodec", "--backend", "tensorrtllm", "--streaming", "-u", grpc_url,
            "--tokenizer", str(tokenizer_dir), *prompts, "--output-tokens-mean", str(output_tokens),
            "--request-count", str(requests), "--concurrency", str(concurrency), "--artifact-dir", str(out_dir)]
    for extra in extra_inputs:
        args += ["--extra-inputs", extra]
    return args


def profile(binary: Path, env: dict, grpc_url: str, tokenizer_dir: Path, out_dir: Path,
            timeout_s: float = 900, **options) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    args = profile_args(grpc_url, tokenizer_dir, out_dir, **options)
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=timeout_s,
                          cwd=out_dir)
    exports = sorted(out_dir.rglob("profile_export_genai_perf.json"))
    if proc.returncode != 0 or not exports:
        raise GenaiPerfError(f"genai-perf failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    export = json.loads(exports[-1].read_text())
    return {"command": ["genai-perf", *args], **{m: export[m] for m in METRICS if m in export}}


def write_prompts(path: Path, prompts: Sequence[str]) -> Path:
    """genai-perf's ``--input-file``: one ``{"text": prompt}`` a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts), encoding="utf-8")
    return path


SUMMARY_STATS = ("avg", "p50", "p90", "min", "max")


def summary(result: dict) -> dict:
    """What a results row keeps of a run: each metric's ``unit`` and its SUMMARY_STATS."""
    return {m: {k: result[m][k] for k in ("unit", *SUMMARY_STATS) if k in result[m]}
            for m in METRICS if isinstance(result.get(m), dict)}


def ttft_ms(result: dict, stat: str = "avg") -> Optional[float]:
    value = result.get("time_to_first_token", {}).get(stat)
    return None if value is None else float(value)
