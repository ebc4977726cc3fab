"""``kvcodec rd`` (``make eval``): every codec at several settings over the eval set.

For each text of ``kvcodec_tools.quality.evalset.EVAL_SET`` the original run is computed once (prefix KV,
teacher-forced log-probabilities, greedy tokens), then each setting's KV is encoded, decoded,
restored and compared (``kvcodec_tools.quality.evaluate.compare``). Texts are shared out over worker processes
(one torch thread each). Then, in the main process alone, each setting's decode + restore speed is
measured on one text with ``--decode-threads`` threads for the decoder and for restore's torch
matrix product (2: a 2-core machine's budget), so that figure
is not slowed by the other workers.

The JSON holds every (text, setting) row, and per setting the summary: ``ratio_vs_fp16`` (total
fp16 bytes over total stored bytes), ``mean_kl`` and ``top1_agreement`` (means over texts),
``greedy_min`` / ``greedy_mean``, ``decode_mb_s`` (MB of fp16 KV restored per second), and
``gate`` with its ``gate_kind``: ``kl_top1`` for the lossy rungs (mean KL <= 0.01 and top-1 >= 0.95);
``exact`` for ``raw`` (32 of 32 greedy tokens on every text); ``task`` for the 8-bit rung
``lossless8``, whose 8-bit rounding flips near-ties in the greedy path (see the results README):
it passes when it is lossless in accuracy on the task of ``--task-json`` (``kvcodec eval-task``:
its accuracy within prefill's 95% interval), and fails when that file does not have it.
Every setting the task file measured (matched by the scheme's identity) also carries
``task_accuracy``, ``task_interval95`` and ``lossless_in_accuracy``.
``best`` names, per codec, the passing setting with the highest ratio; ``headline`` the best
passing video rung against the best passing entropy-coded rung (``video_vs_entropy``), and the
highest-ratio setting lossless in accuracy. ``rd.png`` plots ratio against mean KL, one curve per
codec, with the gate drawn in.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from kvcodec_tools.cli import PLOT_HELP, REPO_ROOT, _list, _settings, common

KL_GATE = 0.01
TOP1_GATE = 0.95
# The gate of each rung not gated on KL and top-1 (see the module's docstring).
GATE_KINDS = {"raw": "exact", "lossless8": "task"}

# Every codec at several settings (rung specs: NAME or NAME:QUALITY).
DEFAULT_SETTINGS = (
    "raw", "lossless8", "int8-zstd", "nlevel-zstd:48", "cachegen:96",
    "transform-zstd:160", "transform-zstd:200",
    "kvtc:300", "kvtc:325", "kvtc:350", "kvtc-w:250", "kvtc-w:300", "kvtc-w:325", "kvtc-w:350",
    "video-q8:16", "video:9", "video:11", "video:13", "video:15", "video-fast:13",
)


@dataclass
class RdConfig:
    settings: Sequence[str] = DEFAULT_SETTINGS
    prefix_tokens: int = 1024
    continuation_tokens: int = 64
    greedy_tokens: int = 32
    workers: int = 2
    decode_threads: int = 2
    texts: Optional[int] = None  # the first N texts of the eval set (None: all)
    chunk_tokens: int = 256
    model_cache: str = ".cache/models"
    engine: str = "transformers"
    model: Optional[str] = None  # a model folder (None: the embedded model)


def _engine(config: RdConfig):
    from kvcodec.engines import open_engine
    from kvcodec.settings import Settings

    return open_engine(Settings.load({"model_cache": config.model_cache, "engine": config.engine,
                                      "model": config.model, "writeback": "off"}))


def _card(config: RdConfig):
    from kvcodec.engines import model_card
    from kvcodec.settings import Settings

    return model_card(Settings.load({"model_cache": config.model_cache, "engine": config.engine,
                                     "model": config.model}))


def _scheme(spec: str, config: RdConfig):
    from kvcodec.format.ladder import parse_rung

    return parse_rung(spec, _card(config))


def _worker(config: RdConfig, texts: List[int], out) -> None:
    import torch

    torch.set_num_threads(1)
    from kvcodec_tools.quality import evalset
    from kvcodec_tools.quality.evaluate import compare, reference

    engine = _engine(config)
    need = config.prefix_tokens + config.continuation_tokens
    for index in texts:
        text = evalset.EVAL_SET[index]
        try:
            (_, ids), = evalset.load([text], engine.tokenize, need)
            ref = reference(engine, ids, config.prefix_tokens, config.continuation_tokens, config.chunk_tokens,
                            config.greedy_tokens)
            for spec in config.settings:
                result = compare(engine, ref, _scheme(spec, config)).to_json()
                out.put({"text": text.name, "kind": text.kind, "setting": spec, **result})
        except Exception as exc:  # reported, and the run fails: an eval set with holes does not compare
            out.put({"text": text.name, "error": f"{type(exc).__name__}: {exc}"})
    out.put(None)


def decode_speed(config: RdConfig, ref_chunks, model_id: str, repeats: int = 3) -> Dict[str, float]:
    """MB of fp16 KV restored per second, per setting, decoding ``ref_chunks`` (best of ``repeats``)."""
    from kvcodec.encode import ChunkEncoder
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.serving.decode import ChunkDecoder
    from kvcodec.serving.restore import restore

    speeds = {}
    auth = ChunkAuth.random()  # the chunks never leave this process
    fp16 = sum(kv.size * 2 for kv in ref_chunks)
    for spec in config.settings:
        scheme = _scheme(spec, config)
        enc = ChunkEncoder(scheme, model_id, auth=auth)
        blobs = [enc.encode(kv, f"s{i}", i, i * config.chunk_tokens) for i, kv in enumerate(ref_chunks)]
        best = float("inf")
        for _ in range(repeats):
            dec = ChunkDecoder(model_id, auth=auth, threads=config.decode_threads)
            t0 = time.perf_counter()
            for i, b in enumerate(blobs):
                restore(dec.decode(b, key=f"s{i}"))
            best = min(best, time.perf_counter() - t0)
            dec.close()
        speeds[spec] = round(fp16 / best / 1e6, 1)
    return speeds


def summarise(rows: List[dict], settings: Sequence[str], task: Optional[Dict[str, dict]] = None) -> List[dict]:
    """Per setting: the aggregate figures and whether the quality gate passes. ``task`` maps a
    setting to its entry in ``kvcodec eval-task``'s ``codecs`` (absent: not measured there)."""
    task = task or {}
    out = []
    for spec in settings:
        mine = [r for r in rows if r.get("setting") == spec]
        if not mine:
            continue
        n = len(mine)
        name = spec.split(":", 1)[0]
        s = {
            "setting": spec,
            "codec": name,
            "quality": int(spec.split(":", 1)[1]) if ":" in spec else None,
            "texts": n,
            "ratio_vs_fp16": round(sum(r["fp16_bytes"] for r in mine) / sum(r["stored_bytes"] for r in mine), 4),
            "mean_kl": round(sum(r["mean_kl"] for r in mine) / n, 6),
            "max_kl": round(max(r["mean_kl"] for r in mine), 6),
            "top1_agreement": round(sum(r["top1_agreement"] for r in mine) / n, 4),
            "greedy_min": min(r["greedy_match_tokens"] for r in mine),
            "greedy_mean": round(sum(r["greedy_match_tokens"] for r in mine) / n, 2),
            "greedy_tokens": mine[0]["greedy_tokens"],
            "encode_s": round(sum(r["encode_s"] for r in mine), 3),
            "decode_s": round(sum(r["decode_s"] for r in mine), 3),
        }
        measured = task.get(spec)
        if measured is not None:
            s["task_accuracy"] = measured["accuracy_codec"]
            s["task_interval95"] = measured["interval95"]
            s["lossless_in_accuracy"] = bool(measured["lossless_in_accuracy"])
        s["gate_kind"] = GATE_KINDS.get(name, "kl_top1")
        if s["gate_kind"] == "exact":
            s["gate"] = s["greedy_min"] == s["greedy_tokens"]
        elif s["gate_kind"] == "task":
            s["gate"] = s.get("lossless_in_accuracy", False)
        else:
            s["gate"] = s["mean_kl"] <= KL_GATE and s["top1_agreement"] >= TOP1_GATE
        out.append(s)
    return out


def best_passing(summary: List[dict]) -> Dict[str, dict]:
    best: Dict[str, dict] = {}
    for s in summary:
        if s["gate"] and (s["codec"] not in best or s["ratio_vs_fp16"] > best[s["codec"]]["ratio_vs_fp16"]):
            best[s["codec"]] = s
    return {k: {"setting": v["setting"], "ratio_vs_fp16": v["ratio_vs_fp16"], "mean_kl": v["mean_kl"],
                "top1_agreement": v["top1_agreement"], "decode_mb_s": v.get("decode_mb_s")} for k, v in best.items()}


def match_task(task_result: dict, identities: Dict[str, str]) -> Dict[str, dict]:
    """The entries of an ``eval-task`` result's ``codecs`` per rd setting, matched by the scheme's
    identity (``video`` there is ``video:13`` here when 13 is its default)."""
    by_id = {entry["codec_id"]: entry for entry in task_result.get("codecs", {}).values()}
    return {spec: by_id[sid] for spec, sid in identities.items() if sid in by_id}


def headline(summary: List[dict], video: Sequence[str]) -> dict:
    """The figures the compression issue asks for: the best passing video setting against the best
    passing entropy-coded one (neither ``raw`` nor a ``video`` codec), and the highest-ratio setting
    lossless in accuracy on the task."""
    def top(rows):
        rows = list(rows)
        return max(rows, key=lambda s: s["ratio_vs_fp16"]) if rows else None

    passing = [s for s in summary if s["gate"]]
    v = top(s for s in passing if s["setting"] in video)
    e = top(s for s in passing if s["setting"] not in video and s["codec"] != "raw")
    lossless = top(s for s in summary if s.get("lossless_in_accuracy"))
    pick = lambda s: None if s is None else {k: s.get(k) for k in (  # noqa: E731
        "setting", "ratio_vs_fp16", "mean_kl", "top1_agreement", "task_accuracy")}
    return {"video": pick(v), "entropy_coded": pick(e),
            "video_vs_entropy": round(v["ratio_vs_fp16"] / e["ratio_vs_fp16"], 3) if v and e else None,
            "lossless_in_accuracy": pick(lossless)}


def plot(summary: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors  # one colour per codec (the default cycle has 10)
    for i, codec in enumerate(dict.fromkeys(s["codec"] for s in summary)):
        pts = sorted((s["ratio_vs_fp16"], max(s["mean_kl"], 1e-6)) for s in summary if s["codec"] == codec)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^Dv"[i % 5], color=colours[(2 * i) % 20 + (i // 10)],
                label=codec)
    ax.axhline(KL_GATE, color="grey", linestyle="--", linewidth=1)
    ax.text(ax.get_xlim()[0], KL_GATE * 1.1, " quality gate (mean KL 0.01)", color="grey", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("compression ratio vs fp16 KV")
    ax.set_ylabel("mean KL(original || restored), nats")
    ax.set_title("Rate against distortion on the eval set (SmolLM2-135M)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_rd(config: RdConfig, json_path: Path, plot_path: Optional[Path], log=None,
           task_path: Optional[Path] = None) -> int:
    from kvcodec.errors import ConfigError
    from kvcodec_tools.quality import evalset

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    schemes = {spec: _scheme(spec, config) for spec in config.settings}  # bad names fail before any work
    task_result = None
    if task_path is not None:
        try:
            task_result = json.loads(Path(task_path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--task-json {task_path}: {exc}") from exc
    indices = list(range(len(evalset.EVAL_SET)))[: config.texts]
    workers = max(1, min(config.workers, len(indices)))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(config, indices[w::workers], queue)) for w in range(workers)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    rows, errors, done = [], [], 0
    total = len(indices) * len(config.settings)
    while done < workers:
        item = queue.get()
        if item is None:
            done += 1
            continue
        if "error" in item:
            errors.append(item)
            log(f"  {item['text']}: {item['error']}")
            continue
        rows.append(item)
        log(f"[{len(rows)}/{total} {time.perf_counter() - t0:.0f} s] {item['text']} {item['setting']}: "
            f"{item['ratio_vs_fp16']:.2f}x KL {item['mean_kl']:.5f} top-1 {item['top1_agreement']:.3f} "
            f"greedy {item['greedy_match_tokens']}/{item['greedy_tokens']}")
    for p in procs:
        p.join()
    if errors:
        log(f"kvcodec rd: {len(errors)} text(s) failed; no results written")
        return 1
    task = match_task(task_result, {spec: sc.identity for spec, sc in schemes.items()}) if task_result else {}
    summary = summarise(rows, config.settings, task)
    log("measuring decode speed ...")
    speeds = _speeds(config)
    for s in summary:
        s["decode_mb_s"] = speeds.get(s["setting"])
    result = {
        "config": {"prefix_tokens": config.prefix_tokens, "continuation_tokens": config.continuation_tokens,
                   "greedy_tokens": config.greedy_tokens, "texts": [evalset.EVAL_SET[i].name for i in indices],
                   "decode_threads": config.decode_threads, "kl_gate": KL_GATE, "top1_gate": TOP1_GATE,
                   "wall_s": round(time.perf_counter() - t0, 1)},
        "summary": summary,
        "best": best_passing(summary),
        "headline": headline(summary, [spec for spec, sc in schemes.items() if sc.codec == "hevc"]),
        "task": None if task_result is None else {
            "source": str(task_path), "task": task_result.get("task"), "samples": task_result.get("samples"),
            "context_tokens": task_result.get("context_tokens"), "accuracy_prefill": task_result.get("accuracy_prefill"),
            "prefill_interval95": task_result.get("prefill_interval95")},
        "rows": sorted(rows, key=lambda r: (r["text"], r["setting"])),
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    if plot_path is not None:
        plot(summary, plot_path)
    for s in summary:
        log(f"{s['setting']:>20}: {s['ratio_vs_fp16']:5.2f}x  KL {s['mean_kl']:.5f}  top-1 {s['top1_agreement']:.3f}  "
            f"greedy min {s['greedy_min']:2d}  decode {s['decode_mb_s']} MB/s  task {s.get('task_accuracy', '-')}  "
            f"{'PASS' if s['gate'] else 'fail'} ({s['gate_kind']})")
    return 0


def _speeds(config: RdConfig) -> Dict[str, float]:
    import torch

    torch.set_num_threads(1)
    from kvcodec_tools.quality import evalset

    engine = _engine(config)
    (_, ids), = evalset.load(evalset.EVAL_SET[:1], engine.tokenize, config.prefix_tokens)
    chunks = list(engine.prefill_chunks(ids, config.chunk_tokens))
    del engine
    torch.set_num_threads(config.decode_threads)  # restore's matrix product gets the same budget
    return decode_speed(config, chunks, _model_id(config))


def _model_id(config: RdConfig) -> str:
    return _card(config).model_id


# -- kvcodec rd ------------------------------------------------------------------------------------
def cmd_rd(args) -> int:
    settings = _settings(args)
    config = RdConfig(settings=args.settings or DEFAULT_SETTINGS, prefix_tokens=args.prefix_tokens,
                      continuation_tokens=args.continuation_tokens, workers=args.workers,
                      decode_threads=args.decode_threads, texts=args.texts, chunk_tokens=settings.chunk_tokens,
                      model_cache=str(settings.model_cache), engine=settings.engine,
                      model=str(settings.model) if settings.model else None)
    return run_rd(config, Path(args.json), Path(args.plot) if args.plot else None,
                  task_path=Path(args.task_json) if args.task_json else None)


def register(sub) -> None:
    """``kvcodec rd`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("rd", help="every codec at several settings over the eval set: rd.json and rd.png")
    common(p)
    p.add_argument("--settings", type=_list(str), help="rung specs (default: every codec at several settings)")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--continuation-tokens", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="processes sharing out the texts")
    p.add_argument("--decode-threads", type=int, default=2, help="threads for the decode speed pass")
    p.add_argument("--texts", type=int, help="only the first N texts of the eval set")
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "rd.json"))
    p.add_argument("--plot", default=None, help=PLOT_HELP)
    p.add_argument("--task-json", help="an eval-task result: gates lossless8 on task accuracy and adds each "
                   "measured rung's accuracy")
    p.set_defaults(func=cmd_rd)
