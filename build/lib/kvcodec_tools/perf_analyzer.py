"""TTFT of the ``kvcodec`` ensemble measured by Triton's own perf_analyzer (2.51, from ``.venv-pa/``).

perf_analyzer drives the decoupled ensemble over gRPC streaming (``-i grpc --streaming --async``,
concurrency 1, ``count_windows`` stabilisation with a small request count, loose stability for a
2-core machine) with a committed input-data file (``perf/inputs/``, see ``make_inputs.py``) and
writes a profile export. TTFT per request is taken from that export: the first response's
timestamp minus the request's timestamp (both nanoseconds, client clock). The first response of
the ensemble is the first generated token (the model sends one response per token, then an empty
final one), which ``ttfts_from_profile`` checks where the export holds the responses' outputs.

perf_analyzer can report success without a stable measurement, so every run's output is checked:
"Failed to obtain stable measurement", a non-zero exit, or a run that recorded no request raises
``UnstableMeasurement`` / ``PerfAnalyzerError`` (the CLI exits non-zero).

The entry point for an orchestrator (one row per link rate and reuse setting)::

    run_perf_analyzer(grpc_url: str, input_json: Path | str, label: str,
                      bandwidth_mbps: float | None, context_tokens: int, *,
                      request_count: int = 3, stability_percentage: int = 50, max_trials: int = 10,
                      timeout_s: float = 1800, work_dir: Path | None = None, log=print) -> dict

returns a row: label, bandwidth_mbps, context_tokens, prompt_tokens, max_tokens, reuse (from the
input data), ttft_p50_s, ttft_p90_s, ttft_mean_s, ttft_min_s, ttft_max_s, requests (counted in
the profile export), reused_tokens (smallest over the requests, from the responses' outputs;
None if not exported), perf_analyzer_p50_request_s (perf_analyzer's own "p50 latency": although
it prints "using the first response for measuring latency", 2.51 reports the latency to the
LAST response here, so it is the whole request, not TTFT), perf_analyzer_args, wall_s.
``run_targets(targets, input_jsons, context_tokens)`` runs a list of
``Target(label, bandwidth_mbps, grpc_url)`` and ``write_results(rows)`` writes
``perf/results/perf_analyzer.json`` as ``{"rows": [...], "perf_analyzer_version": "2.51.0"}``.

CLI::

    .venv/bin/python perf/kvcodec_tools/perf_analyzer.py --url 127.0.0.1:8001 --input-data perf/inputs/default.reuse.json \\
        [--input-data perf/inputs/default.prefill.json] [--context-tokens 1301] [--label local] \\
        [--bandwidth-mbps 100] [--target LABEL,MBPS,URL ...] [--output perf/results/perf_analyzer.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from kvcodec_tools.procs import Process
from kvcodec_tools.stats import percentile

PERF_DIR = Path(__file__).resolve().parents[1]  # perf/: inputs, results
REPO_ROOT = PERF_DIR.parent
SETUP_SCRIPT = PERF_DIR / "perf_analyzer_env.sh"
RESULTS_PATH = PERF_DIR / "results" / "perf_analyzer.json"
MODEL = "kvcodec"
UNSTABLE_MARKER = "Failed to obtain stable measurement"


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer could not be set up, failed, or measured nothing usable."""


class UnstableMeasurement(PerfAnalyzerError):
    """perf_analyzer printed "Failed to obtain stable measurement" (whatever its exit code)."""


@dataclass(frozen=True)
class Target:
    """Where to measure: a label, the link rate in Mbit/s (None: no throttled link) and the
    server's gRPC address ``host:port``."""
    label: str
    bandwidth_mbps: Optional[float]
    grpc_url: str

    @classmethod
    def parse(cls, spec: str) -> "Target":
        """``LABEL,MBPS,URL`` (MBPS may be empty or ``none``)."""
        parts = spec.split(",")
        if len(parts) != 3 or not parts[0] or not parts[2]:
            raise ValueError(f"a target is LABEL,MBPS,URL, got {spec!r}")
        mbps = None if parts[1].strip().lower() in ("", "none") else float(parts[1])
        return cls(parts[0], mbps, parts[2])


# --- setup -----------------------------------------------------------------------------------

def ensure_perf_analyzer() -> Tuple[Path, dict]:
    """Create or check ``.venv-pa/`` (``perf_analyzer_env.sh``; seconds when already there) and
    return the binary and the environment to run it in (``LD_LIBRARY_PATH`` with libcudart)."""
    proc = subprocess.run(["bash", str(SETUP_SCRIPT), "--print"], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise PerfAnalyzerError(f"{SETUP_SCRIPT.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    binary = Path(values["PERF_ANALYZER"])
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = values["LD_LIBRARY_PATH"] + (
        os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return binary, env


def perf_analyzer_version(binary: Path, env: dict) -> str:
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, env=env, timeout=60)
    out = proc.stdout + proc.stderr  # it prints the version on stderr
    m = re.search(r"Perf Analyzer Version (\S+)", out)
    if not m:
        raise PerfAnalyzerError(f"{binary} --version printed no version: {out[-500:]!r}")
    return m.group(1)


# --- the command, its output and its profile export ------------------------------------------

def perf_analyzer_args(grpc_url: str, input_json: Union[str, Path], profile_path: Union[str, Path], *,
                       request_count: int = 3, stability_percentage: int = 50, max_trials: int = 10,
                       model: str = MODEL) -> List[str]:
    """perf_analyzer's arguments (without the binary): gRPC streaming to the decoupled ensemble,
    concurrency 1, count windows of ``request_count`` requests."""
    return ["-m", model, "-u", grpc_url, "-i", "grpc", "--streaming", "--async",
            "--concurrency-range", "1",
            "--measurement-mode", "count_windows", "--measurement-request-count", str(request_count),
            "--stability-percentage", str(stability_percentage), "--max-trials", str(max_trials),
            "--input-data", str(input_json), "--profile-export-file", str(profile_path)]


def check_output(output: str, returncode: int) -> None:
    """Raise if perf_analyzer's combined stdout/stderr shows an unstable or failed run."""
    if UNSTABLE_MARKER in output:
        raise UnstableMeasurement(f"perf_analyzer: {UNSTABLE_MARKER} (exit code {returncode}):\n"
                                  f"{_tail(output)}")
    if returncode != 0:
        raise PerfAnalyzerError(f"perf_analyzer exited with code {returncode}:\n{_tail(output)}")


def reported_p50_latency_s(output: str) -> Optional[float]:
    """perf_analyzer's own client "p50 latency". With this decoupled ensemble, 2.51 measures it to
    the last response (checked against the profile export), so it is not a TTFT."""
    m = re.search(r"p50 latency: (\d+) usec", output)
    return int(m.group(1)) / 1e6 if m else None


def _response_has_token(outputs: dict) -> bool:
    ids = outputs.get("output_ids")
    if isinstance(ids, list):
        return len(ids) > 0
    return ids is not None and outputs.get("stats", "") != ""  # the final response carries no stats


def ttfts_from_profile(profile: dict) -> Tuple[List[float], List[int]]:
    """(TTFT in seconds per request, reused_tokens per request) from a profile export.

    The export is ``{"experiments": [{"experiment": {...}, "requests": [{"timestamp": ns,
    "response_timestamps": [ns, ...], "response_outputs": [{...}, ...]}, ...],
    "window_boundaries": [...]}], "version": ...}``. Every request of every experiment counts.
    Raises ``PerfAnalyzerError`` when no request got a response, when a request got none (at
    concurrency 1 each is awaited, so that is a failed request), or when a first response
    carries no token.
    """
    ttfts: List[float] = []
    reused: List[int] = []
    requests = [r for e in profile.get("experiments", []) for r in e.get("requests", [])]
    if not requests:
        raise PerfAnalyzerError("the profile export records no request")
    for i, req in enumerate(requests):
        stamps = req.get("response_timestamps") or []
        if not stamps:
            raise PerfAnalyzerError(f"request {i} of the profile export got no response")
        ttft = (int(stamps[0]) - int(req["timestamp"])) / 1e9
        if ttft <= 0:
            raise PerfAnalyzerError(f"request {i}: first response at or before the request ({ttft} s)")
        outputs = req.get("response_outputs") or []
        if outputs:
            if not _response_has_token(outputs[0]):
                raise PerfAnalyzerError(f"request {i}: the first response carries no token: {outputs[0]!r:.300}")
            if "reused_tokens" in outputs[0]:
                reused.append(int(outputs[0]["reused_tokens"]))
        ttfts.append(ttft)
    return ttfts, reused


def summarize(ttfts: Sequence[float]) -> dict:
    return {"ttft_p50_s": round(percentile(ttfts, 50), 4), "ttft_p90_s": round(percentile(ttfts, 90), 4),
            "ttft_mean_s": round(sum(ttfts) / len(ttfts), 4), "ttft_min_s": round(min(ttfts), 4),
            "ttft_max_s": round(max(ttfts), 4), "requests": len(ttfts)}


def _input_facts(input_json: Path) -> dict:
    """prompt_tokens, max_tokens and reuse of an input-data file; a text prompt's token count from
    the ``N.meta.json`` that ``make_inputs`` writes beside ``N.reuse.json`` / ``N.prefill.json``."""
    try:
        first = json.loads(Path(input_json).read_text())["data"][0]
        if "text_input" in first:
            meta = Path(input_json).with_name(Path(input_json).name.split(".")[0] + ".meta.json")
            prompt_tokens = int(json.loads(meta.read_text())["prompt_tokens"])
        else:
            ids = first["input_ids"]
            prompt_tokens = len(ids["content"] if isinstance(ids, dict) else ids)
        return {"prompt_tokens": prompt_tokens, "max_tokens": int(first["max_tokens"][0]),
                "reuse": bool(first["reuse"][0])}
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise PerfAnalyzerError(f"{input_json}: not a kvcodec perf_analyzer input-data file, or a text one without "
                                f"its N.meta.json ({exc})") from None


def _tail(text: str, chars: int = 3000) -> str:
    return text[-chars:]


def _run(cmd: List[str], env: dict, timeout_s: float, out_path: Path) -> Tuple[int, str]:
    """Run perf_analyzer in its own process group, its output into ``out_path``; on timeout, stop
    that group (by its id). Returns the exit code and the output."""
    proc = Process("perf_analyzer", cmd, out_path, env=env, append=False).start()
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.stop(grace_s=5.0)
        output = out_path.read_text(errors="replace")
        raise PerfAnalyzerError(f"perf_analyzer ran past {timeout_s:.0f} s:\n{_tail(output)}") from None
    return code, out_path.read_text(errors="replace")


# --- the entry points --------------------------------------------------------------------------

def run_perf_analyzer(grpc_url: str, input_json: Union[str, Path], label: str, bandwidth_mbps: Optional[float],
                      context_tokens: int, *, request_count: int = 3, stability_percentage: int = 50,
                      max_trials: int = 10, timeout_s: float = 1800, work_dir: Optional[Path] = None,
                      log=print) -> dict:
    """Measure TTFT with perf_analyzer against the ``kvcodec`` ensemble at ``grpc_url``
    (``host:port``) with one input-data file, and return one result row (see the module
    docstring). ``bandwidth_mbps`` and ``context_tokens`` are recorded as given; ``reuse``,
    ``prompt_tokens`` and ``max_tokens`` are read from the input data. The perf_analyzer output
    and profile export are kept in ``work_dir`` (default: a temporary folder, removed).
    Raises ``UnstableMeasurement`` or ``PerfAnalyzerError``; never returns a row without requests.
    """
    input_json = Path(input_json).resolve()
    facts = _input_facts(input_json)
    binary, env = ensure_perf_analyzer()
    with tempfile.TemporaryDirectory(prefix="perf-analyzer-") as tmp:
        out_dir = Path(work_dir) if work_dir else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{label}-{'reuse' if facts['reuse'] else 'prefill'}")
        profile_path = out_dir / f"{stem}.profile.json"
        profile_path.unlink(missing_ok=True)
        args = perf_analyzer_args(grpc_url, input_json, profile_path, request_count=request_count,
                                  stability_percentage=stability_percentage, max_trials=max_trials)
        log(f"perf_analyzer [{label}, reuse={str(facts['reuse']).lower()}]: {' '.join(args)}")
        t0 = time.perf_counter()
        code, output = _run([str(binary), *args], env, timeout_s, out_dir / f"{stem}.out.txt")
        wall = time.perf_counter() - t0
        check_output(output, code)
        if not profile_path.is_file():
            raise PerfAnalyzerError(f"perf_analyzer wrote no profile export {profile_path}:\n{_tail(output)}")
        ttfts, reused = ttfts_from_profile(json.loads(profile_path.read_text()))
    row = {"label": label, "bandwidth_mbps": bandwidth_mbps, "context_tokens": int(context_tokens), **facts,
           **summarize(ttfts), "reused_tokens": min(reused) if reused else None,
           "perf_analyzer_p50_request_s": reported_p50_latency_s(output),
           "perf_analyzer_args": _portable_args(args, input_json, profile_path), "wall_s": round(wall, 1)}
    log(f"  {row['requests']} requests in {wall:.0f} s: TTFT p50 {row['ttft_p50_s']:.3f} s, "
        f"p90 {row['ttft_p90_s']:.3f} s, mean {row['ttft_mean_s']:.3f} s; reused tokens {row['reused_tokens']}")
    return row


def _portable_args(args: List[str], input_json: Path, profile_path: Path) -> List[str]:
    """The arguments as recorded: the input data relative to the repository, the export's name only."""
    try:
        shown = str(input_json.relative_to(REPO_ROOT))
    except ValueError:
        shown = str(input_json)
    return [shown if a == str(input_json) else profile_path.name if a == str(profile_path) else a for a in args]


RELAXED_STABILITY = 100  # a second try's stability percentage, after perf_analyzer found none


def run_targets(targets: Iterable[Target], input_jsons: Sequence[Union[str, Path]], context_tokens: int,
                **options) -> List[dict]:
    """One row per (target, input-data file), in that order; options go to ``run_perf_analyzer``.
    A measurement perf_analyzer calls unstable (on a shared machine its windows can stay more than
    ``stability_percentage`` apart) is taken again once with ``RELAXED_STABILITY``; the row's
    ``perf_analyzer_args`` say which rule held."""
    rows = []
    for t in targets:
        for path in input_jsons:
            try:
                rows.append(run_perf_analyzer(t.grpc_url, path, t.label, t.bandwidth_mbps, context_tokens, **options))
            except UnstableMeasurement:
                if options.get("stability_percentage", 50) >= RELAXED_STABILITY:
                    raise
                options.get("log", print)(f"  unstable: again with --stability-percentage {RELAXED_STABILITY}")
                rows.append(run_perf_analyzer(t.grpc_url, path, t.label, t.bandwidth_mbps, context_tokens,
                                              **dict(options, stability_percentage=RELAXED_STABILITY)))
    return rows


def write_results(rows: List[dict], path: Union[str, Path] = RESULTS_PATH, version: Optional[str] = None) -> dict:
    """Write ``{"rows": rows, "perf_analyzer_version": version}`` (version asked of the binary if
    not given) and return it."""
    if not rows:
        raise PerfAnalyzerError("no rows to write")
    if version is None:
        version = perf_analyzer_version(*ensure_perf_analyzer())
    doc = {"rows": rows, "perf_analyzer_version": version}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="TTFT of the kvcodec ensemble with perf_analyzer (gRPC streaming)")
    p.add_argument("--url", help="gRPC host:port of one server (or give --target)")
    p.add_argument("--label", default="local")
    p.add_argument("--bandwidth-mbps", type=float, default=None)
    p.add_argument("--target", action="append", default=[], metavar="LABEL,MBPS,URL")
    p.add_argument("--input-data", action="append", required=True, type=Path,
                   help="input-data JSON (repeatable: e.g. the reuse and the prefill file)")
    p.add_argument("--context-tokens", type=int, default=None,
                   help="default: the context_tokens of the input data's .meta.json")
    p.add_argument("--request-count", type=int, default=3)
    p.add_argument("--stability-percentage", type=int, default=50)
    p.add_argument("--max-trials", type=int, default=10)
    p.add_argument("--work-dir", type=Path, default=None, help="keep perf_analyzer's outputs here")
    p.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = p.parse_args(argv)
    try:
        targets = [Target.parse(s) for s in args.target]
    except ValueError as exc:
        p.error(str(exc))
    if args.url:
        targets.insert(0, Target(args.label, args.bandwidth_mbps, args.url))
    if not targets:
        p.error("give --url or --target")
    context_tokens = args.context_tokens
    if context_tokens is None:
        meta = Path(re.sub(r"\.(reuse|prefill)\.json$", ".meta.json", str(args.input_data[0])))
        if not meta.is_file():
            p.error(f"--context-tokens is needed (no {meta})")
        context_tokens = json.loads(meta.read_text())["context_tokens"]
    try:
        rows = run_targets(targets, args.input_data, context_tokens, request_count=args.request_count,
                           stability_percentage=args.stability_percentage, max_trials=args.max_trials,
                           work_dir=args.work_dir)
        write_results(rows, args.output)
    except PerfAnalyzerError as exc:
        print(f"perf_analyzer.py: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
