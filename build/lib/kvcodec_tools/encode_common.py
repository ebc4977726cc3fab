"""What the encode benchmarks share (``kvcodec_tools.encode_speed`` runs them): the x265 candidates
(``CANDIDATES``: an x265 preset, coding tools in ``Hevc``'s ``x265`` parameter, x265 frame threads),
the baseline ``BASE`` (the ``video`` scheme's settings) and ``COMPARED``, all at ``QP``; a
candidate's coder and codec params; the process's CPU time; and the summary of timed rounds.
"""
from __future__ import annotations

import resource
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np

QP = 7


@dataclass(frozen=True)
class Candidate:
    name: str
    preset: str = "medium"
    x265: str = ""  # Hevc's x265 parameter (coding tools)
    threads: int = 1  # x265 frame threads (Hevc's threads: ctx.thread_count)
    note: str = ""


BASE = "medium"
# The candidate timed beside the rung in the ingest rates and on two cores: the fastest at the
# rung's KV error (rejected on KL: perf/results/README.md, "Encode speed").
COMPARED = "ctu16-info0"
CANDIDATES = (
    Candidate(BASE, note="the video scheme as it is (ingest's threads=1)"),
    Candidate("medium-ft2", threads=2, note="2 x265 frame threads (ingest threads=2)"),
    Candidate("medium-info0", x265="info=0", note="no x265 version/options SEI"),
    Candidate("fast", preset="fast"),
    Candidate("ultrafast", preset="ultrafast"),
    Candidate("rd2", x265="rd=2"),
    Candidate("rd1", x265="rd=1"),
    Candidate("rd2-rdoq1", x265="rd=2:rdoq-level=1"),
    Candidate("mincu16", x265="min-cu-size=16", note="no 8x8 CUs, no 4x4 intra PUs"),
    Candidate("mincu16-rdoq1", x265="min-cu-size=16:rdoq-level=1"),
    Candidate("ctu32", x265="ctu=32"),
    Candidate("ctu16", x265="ctu=16:max-tu-size=16"),
    Candidate("ctu16-info0", x265="ctu=16:max-tu-size=16:info=0", note="16x16 CTUs, no SEI"),
    Candidate("ctu16-nosao-info0", x265="ctu=16:max-tu-size=16:sao=0:info=0"),
    Candidate("maxtu16-nosis", x265="max-tu-size=16:strong-intra-smoothing=0"),
    Candidate("nosao", x265="sao=0"),
    Candidate("nosao-info0", x265="sao=0:info=0", note="no SAO, no SEI"),
    Candidate("rskip2", x265="rskip=2"),
)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _coder(c: Candidate, qp: int = QP, pools: int = 0):
    from kvcodec.bitstream.hevc import Hevc

    coder = Hevc(lossless=False, qp=qp, preset=c.preset, bit_depth=10, tune="mse", x265=c.x265,
                 threads=c.threads)
    if pools:  # x265's thread pool (not a coding tool: only where the cores are pinned)
        base = coder.x265_params
        coder.x265_params = lambda: f"{base()}:pools={pools}"
    return coder


def codec_params(c: Candidate, qp: int = QP) -> Dict[str, Any]:
    """The ``video`` scheme's codec_params with this candidate's settings (threads are runtime)."""
    params: Dict[str, Any] = {"lossless": False, "qp": qp, "preset": c.preset, "bit_depth": 10, "tune": "mse"}
    if c.x265:
        from kvcodec.bitstream.hevc import x265_tools

        params["x265"] = x265_tools(c.x265)
    return params


def _summary(rows: Dict[str, List[List[float]]]) -> Dict[str, float]:
    """``rows[chunk] = [value per round]`` -> mean over chunks of the median over rounds."""
    return float(np.mean([statistics.median(v) for v in rows.values()]))
