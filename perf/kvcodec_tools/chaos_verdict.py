"""The verdict of a chaos run (``kvcodec_tools.chaos``): answers checked, faults healed, resources
flat (``high_water``, ``resource_growth``: the last window against the earlier high-water mark, within
``LIMITS``), all of it in one summary (``summarize``), and the timeline plot (``plot``).
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .chaos_plan import PROMPT_KINDS, Answer, reuse_not_back, ttft_bounds
from .footprint import growth
from .stats import percentile

# how far the last window may rise above the earlier high-water mark (``high_water``): chaos moves
# connections and threads with the load and the faults, so a few more is not a leak; RSS by less than
# 5%, as the soak's rule; processes not at all
LIMITS = {"rss_fraction": 0.05, "fds": 16, "sockets": 16, "threads": 8, "processes": 0}


def high_water(samples: Sequence[dict], warmup_s: float, window_s: float,
               keys: Sequence[str]) -> Tuple[Dict[str, Optional[float]], Dict[str, Optional[float]]]:
    """({key: the last window's median - the highest median of the earlier windows}, {key: that
    highest median}): windows of ``window_s`` from ``warmup_s`` on, the last one the last ``window_s``
    seconds. A leak climbs past every level the process tree reached before; a server restarted
    mid-run warms up again to a level it had already reached, which a last-minus-first growth would
    take for one. None for every key when the run is too short for an earlier window."""
    if not samples:
        return {k: None for k in keys}, {k: None for k in keys}
    end = max(s["t_s"] for s in samples)
    last = [s for s in samples if s["t_s"] > end - window_s]
    earlier = []
    t = warmup_s
    while t + window_s <= end - window_s:
        win = [s for s in samples if t <= s["t_s"] < t + window_s]
        if win:
            earlier.append(win)
        t += window_s
    if not last or not earlier:
        return {k: None for k in keys}, {k: None for k in keys}
    top = {k: max(statistics.median(s[k] for s in win) for win in earlier) for k in keys}
    return {k: statistics.median(s[k] for s in last) - top[k] for k in keys}, top


def resource_growth(samples: Sequence[dict], servers: int, warmup_s: float, window_s: float) -> Dict[int, dict]:
    """Per server, over the samples where the server was whole (ready, with its usual number of
    processes: not mid-restart): how far the last window's RSS, fds, sockets, threads and processes
    are above their earlier high-water mark (``high_water``), the last-minus-first growth
    (``soak.growth``, information), whether it is flat (``LIMITS``, on the high-water rise) and why not."""
    keys = ("rss_bytes", "fds", "sockets", "threads", "processes")
    out = {}
    for i in range(servers):
        mine = [s for s in samples if s["server"] == i and s.get("ready", True)]
        usual = statistics.mode(s["processes"] for s in mine) if mine else 0
        whole = [s for s in mine if s["processes"] == usual]
        above, top = high_water(whole, warmup_s, window_s, keys)
        grown, base = growth(whole, warmup_s, window_s, keys)
        why = []
        if any(v is None for v in above.values()):
            why.append("too short: no earlier window before the last one")
        else:
            if above["rss_bytes"] >= LIMITS["rss_fraction"] * max(top["rss_bytes"], 1):
                why.append(f"RSS rose {above['rss_bytes'] / 2**20:.1f} MiB above its earlier high-water mark "
                           f"({100 * above['rss_bytes'] / max(top['rss_bytes'], 1):.1f}%)")
            for k in ("fds", "sockets", "threads", "processes"):
                if above[k] > LIMITS[k]:
                    why.append(f"{k} rose {above[k]:g} above its earlier high-water mark (> {LIMITS[k]})")
        out[i] = {"above_high_water": above, "high_water": top, "growth": grown, "first_window_median": base,
                  "usual_processes": usual, "samples_whole": len(whole), "flat": not why, "not_flat": why}
    return out


def summarize(doc: dict, config) -> dict:
    """The verdict of a run (``doc``: what ``chaos.run_chaos`` gathered) under ``config`` (``chaos.ChaosConfig``)."""
    answers: List[Answer] = doc["answers"]
    verdicts = Counter(a.verdict for a in answers)
    bounds = ttft_bounds(answers, doc["alone"])
    over = [i for i, b in bounds.items() if answers[i].ttft_s > b]
    ttft = {}
    for kind in PROMPT_KINDS:
        xs = [a.ttft_s for a in answers if a.kind == kind and a.ttft_s is not None]
        if xs:
            ttft[kind] = {"requests": len(xs), "p50_s": round(percentile(xs, 50), 3),
                          "p90_s": round(percentile(xs, 90), 3), "max_s": round(max(xs), 3)}
    res = resource_growth(doc["samples"], config.servers, config.warmup_s, config.window_s)
    faults = [r.to_json() for r in doc["faults"]]
    not_back, unobserved = reuse_not_back(answers, faults)
    return {
        "duration_s": config.duration_s, "wall_s": round(doc["wall_s"], 1), "servers": config.servers,
        "clients": config.clients, "store": config.store, "requests": len(answers),
        "wrong_answers": verdicts["wrong"], "lost_requests": verdicts["lost"], "unchecked_answers": verdicts["unchecked"],
        "corrupt_chunks_stored": doc["corrupt"], "chunks_stored": doc["stored"], "verify_errors": doc["verify_errors"],
        "over_bound": len(over), "bounded_requests": len(bounds),
        "retried_requests": sum(1 for a in answers if a.attempts > 1),
        "reused_requests": sum(1 for a in answers if a.reused_tokens > 0),
        "by_kind": {k: sum(1 for a in answers if a.kind == k) for k in PROMPT_KINDS},
        "ttft": ttft,
        "faults": faults,
        "faults_unhealed": sum(1 for f in faults if f["healed_s"] is None),
        "faults_reuse_not_back": not_back, "faults_healed_after_the_load": unobserved,
        "restarts": doc["restarts"], "churn_delete_failures": doc["churn_errors"],
        "miss_reasons": dict(Counter(a.miss_reason.split(":")[0] for a in answers if a.miss_reason).most_common(12)),
        "bad_answers": [asdict(a) for a in answers if a.verdict in ("wrong", "lost")][:20],
        "over_bound_examples": [{**{k: getattr(answers[i], k) for k in ("prompt", "start_s", "ttft_s", "attempts",
                                                                          "miss_reason")},
                                 "bound_s": round(bounds[i], 3)} for i in over[:10]],
        "resources": {"growth": {str(k): v for k, v in res.items()}, "limits": LIMITS,
                      "flat": all(v["flat"] for v in res.values())},
        "reference_failures": doc["reference_failures"],
        "prompt_tokens": doc["prompt_tokens"], "full_reuse_tokens": doc["full"],
    }


COLORS = {"store-kill": "C3", "store-pause": "C1", "trickle": "C4", "stall": "C5", "failover": "C6",
          "disk-full": "C8", "stub-kill": "C0", "decoder-kill": "C9"}


def plot(result: dict, path: Path) -> None:
    """The timeline: TTFT of every answer (by kind; wrong and lost marked), the faults as spans, and
    each server's RSS and open fds / sockets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(13, 9), sharex=True, gridspec_kw={"height_ratios": [3, 1.4, 1.4]})
    ax = axes[0]
    for k, kind in enumerate(PROMPT_KINDS):
        pts = [(a[0], a[2]) for a in result["answers"] if a[1].rstrip("0123456789") == kind and a[2] is not None]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=9, alpha=0.7, color=f"C{k}", label=kind)
    bad = [(a[0], a[2] or 0) for a in result["answers"] if a[5] in ("wrong", "lost")]
    if bad:
        ax.scatter(*zip(*bad, strict=True), s=60, marker="x", color="red", label="wrong / lost")
    seen = set()
    for f in result["faults"]:
        end = f["healed_s"] if f["healed_s"] is not None else result["wall_s"]
        for a in axes:
            a.axvspan(f["at_s"], max(end, f["at_s"] + 1.0), color=COLORS.get(f["kind"], "grey"), alpha=0.15,
                      label=None if (f["kind"] in seen or a is not ax) else f["kind"])
        seen.add(f["kind"])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s), client side")
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    ax.grid(True, alpha=0.3)
    series = defaultdict(list)
    for s in result["resource_series"]:
        series[s["server"]].append(s)
    for i, ss in sorted(series.items()):
        ts = [s["t_s"] for s in ss]
        axes[1].plot(ts, [s["rss_bytes"] / 2**20 for s in ss], label=f"server {i}")
        axes[2].plot(ts, [s["fds"] for s in ss], label=f"server {i} fds")
        axes[2].plot(ts, [s["sockets"] for s in ss], linestyle="--", label=f"server {i} sockets")
    axes[1].set_ylabel("RSS (MiB)")
    axes[2].set_ylabel("open fds / sockets")
    axes[2].set_xlabel("seconds under load")
    for a in axes[1:]:
        a.legend(fontsize=7)
        a.grid(True, alpha=0.3)
    fig.suptitle(f"kvcodec soak --chaos: {result['servers']} servers ({result['engine']}), {result['clients']} clients, "
                 f"store {result['store']}; {result['requests']} answers, {result['wrong_answers']} wrong, "
                 f"{result['lost_requests']} lost, {len(result['faults'])} faults")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
