"""``kvcodec bench peers``: this project against LMCache, side by side, one run, one machine.

The same model (the embedded SmolLM2 on vLLM's CPU build, float32), the same held-out texts
(standard-library modules cut to ``--context-tokens``, a question after each), the same store
(``--store``: a Redis server, or SeaweedFS's S3 gateway, which LMCache's ``s3`` adapter reaches
virtual-hosted at ``<bucket>.s3.peers.test``, a name the run adds to /etc/hosts) behind the same
shaped link (``kvcodec_tools.shaping``: netns + tc, else the userspace shaper; S3: netns only) at
each ``--bandwidth-mbps``. Methods (``--methods``):

- ``prefill``: vLLM's OpenAI server, no connector, its prefix cache off;
- ``lmcache`` / ``lmcache-fp8``: vLLM + LMCache in its multiprocess mode (``LMCacheMPConnector``,
  an ``lmcache server`` with the store as its L2 through ``resp`` or ``s3``; ``fp8``: its fp8 serde), from
  ``.venv-lmcache`` (``make setup-lmcache``);
- ``lmcache-ram``: LMCache lossless with one ``lmcache server`` for the populating and the measuring
  vLLM: a new vLLM reads the prefix from the server's RAM tier (L1), not across the link (LMCache's
  local tier outliving a vLLM restart; not in the default methods);
- ``kvcodec-vllm-serve-ram``: its answer, KVCodec in ``vllm serve`` with a local tier in RAM
  (``KVCODEC_LOCAL_STORE`` in ``/dev/shm``, ``kvcodec.store.tiered``) that the populating server's
  write-back fills and the measuring server reads (not in the default methods);
- ``kvcodec-vllm-serve`` (the adaptive ladder) and ``kvcodec-vllm-serve:RUNG`` (one static rung,
  measured with the first ``--clients`` count only: it shows what the ladder chooses between):
  vLLM's OpenAI server with ``KVCodecConnector`` (``docs/engines-and-models.md``), from ``.venv-vllm``;
- ``kvcodec-ensemble`` (and ``:RUNG``): the Triton ensemble (a real tritonserver on the model
  repository) on the vLLM engine, over gRPC streaming (``KVCodecClient``).

Each method, at each rate: a first server computes every prompt and stores its KV (write-back /
LMCache's store); then a new server (and a new ``lmcache server``: its memory tier empty) answers
a short warm-up prompt (no stored chunk: the server's one-time costs) and then each prompt once,
so every reuse crosses the link (KVCodec's servers keep one home across the two, as a deployed
server does: its cost model has seen the prefills and the link). vLLM's prefix cache is on, as
users run it; the prompts share no block, so nothing measured is served locally
(``local_hit_tokens``: vLLM's ``prefix_cache_hits`` counter, the ensemble's ``local_tokens``, 0).
Per row: TTFT (streamed, first token), the tokens (8, greedy) against prefill's, the bytes the store
sent per reused token (Redis's ``INFO``; S3: the bytes the link's veth carried from it, headers
included), CPU seconds and peak RSS of every process of the method (LMCache's server
included); with ``--clients 4`` the prompts go 4 at a time. After the one-client measurement the
same server answers the quality gate (``kvcodec_tools.quality.served_gate``: teacher-forced on
prefill's greedy path, mean KL and top-1 agreement over its top-5000 log-probabilities; the lossy
rows' like-for-like test; not asked of the ensemble, whose interface has no log-probabilities; LMCache's
rows at the fastest rate only, and not below ``LMCACHE_GATE_MIN_MBPS``: its serde does not change
with the rate or the store, and its server reads the whole prefix across the link again for each of
the gate's requests).
Rows (``perf/results/peers.json``, ``"rows"``): ``method``, ``bandwidth_mbps``, ``clients``,
``context_tokens``, ``ttft_p50_s``, ``ttft_p90_s``, ``bytes_per_token``, ``tokens_match``, ``gate``,
``local_hit_tokens``, ``mode`` (vLLM's process mode), ``processes``; KVCodec's ``vllm serve`` rows
also ``rungs`` (chunks read per rung, from its ``/metrics``) and ``costs`` (what its cost model held
after the row, per 256-token chunk: bytes, decode and restore seconds per rung, the link's rate:
the adaptive ladder's inputs, beside what it chose); and a plot.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from .peers_servers import (
    ADAPTIVE_LADDER,
    LMCACHE_VENV,
    LOGPROBS_ARGS,
    VLLM_PYTHON,
    ensemble_server,
    lmcache_server,
    one_port,
    run_chunk_key,
)
from .peers_stores import PeersStore, store_behind_link
from .procstats import Footprint

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "perf" / "results" / "peers.json"
METHODS = ("prefill", "lmcache", "lmcache-fp8", "lmcache-ram", "kvcodec-vllm-serve", "kvcodec-vllm-serve-ram",
           "kvcodec-ensemble")
LOCAL_TIERS = ("lmcache-ram", "kvcodec-vllm-serve-ram")  # asked for by name: a tier on the machine, not the link
KVCODEC = ("kvcodec-vllm-serve", "kvcodec-ensemble")
SOURCES = ("argparse.py", "typing.py", "inspect.py", "pathlib.py", "ast.py", "enum.py", "subprocess.py", "tarfile.py")
QUESTION = "\n\n# Question: what does the code above do?\n# Answer:"
ANSWER_TOKENS = 8
STORES = ("redis", "s3")
LMCACHE_GATE_MIN_MBPS = 1000.0


@dataclass
class PeersConfig:
    bandwidths: List[float] = field(default_factory=lambda: [100.0, 1000.0, 10000.0])
    context_tokens: int = 4096
    contexts: int = 4
    clients: List[int] = field(default_factory=lambda: [1, 4])
    methods: List[str] = field(default_factory=lambda: [m for m in METHODS if m not in LOCAL_TIERS])
    delay_ms: float = 1.0
    link_mode: str = "auto"
    chunk_tokens: int = 256
    store: str = "redis"  # redis | s3 (SeaweedFS): the one store every method uses


def method_parts(method: str) -> Tuple[str, Optional[str]]:
    """``kvcodec-vllm-serve:raw`` -> (``kvcodec-vllm-serve``, ``raw``)."""
    base, _, rung = method.partition(":")
    if base not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)} (kvcodec-vllm-serve:RUNG for a static rung), "
                         f"got {method!r}")
    if rung and base not in KVCODEC:
        raise ValueError(f"only {' and '.join(KVCODEC)} take a rung, got {method!r}")
    return base, rung or None


def prompts(tokenizer, config: PeersConfig) -> List[str]:
    from kvcodec_tools.texts import cut_to_tokens, stdlib_text

    if config.contexts > len(SOURCES):
        raise ValueError(f"at most {len(SOURCES)} contexts")
    return [cut_to_tokens(tokenizer, stdlib_text(s), config.context_tokens) + QUESTION
            for s in SOURCES[:config.contexts]]


def summarize(ttfts: Sequence[float]) -> Dict[str, float]:
    ordered = sorted(ttfts)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]

    return {"ttft_p50_s": round(statistics.median(ordered), 4), "ttft_p90_s": round(pct(90), 4),
            "ttft_mean_s": round(statistics.fmean(ordered), 4)}


# -- the methods' servers ----------------------------------------------------------------------------


@contextlib.contextmanager
def method_server(method: str, model: Path, root: Path, store: PeersStore, config: PeersConfig, prefix_cache: bool,
                  footprint: Footprint, lmcache: Optional[Tuple[int, int]] = None) -> Iterator[object]:
    """The method's server (and LMCache's server, unless ``lmcache`` (its port, pid) is one already
    running), ready: vLLM's OpenAI server, or the Triton ensemble behind ``EnsembleServer``'s two calls."""
    from kvcodec_tools.services.vllm_serve import VllmServe

    base, rung = method_parts(method)
    root.mkdir(parents=True, exist_ok=True)
    if base == "prefill":
        with VllmServe(model, root, {}, one_port(), connector=False, prefix_cache=prefix_cache,
                       python=VLLM_PYTHON, extra_args=LOGPROBS_ARGS) as server:
            footprint.watch("vllm", server.process.pid)
            yield server
        return
    if base == "kvcodec-ensemble":
        with ensemble_server(root, store, rung, prefix_cache) as server:
            footprint.watch("tritonserver", server.pid)
            yield server
        return
    if base in ("kvcodec-vllm-serve", "kvcodec-vllm-serve-ram"):
        env = {**store.env, "KVCODEC_HOME": str(root.parent / "home"), "KVCODEC_STORE": store.url,  # one home: costs
               "KVCODEC_MODEL_CACHE": str(REPO / ".cache" / "models"), "KVCODEC_THREADS": "1",
               "KVCODEC_CHUNK_KEY": run_chunk_key(root.parent), "KVCODEC_LADDER": rung or ADAPTIVE_LADDER,
               "KVCODEC_WRITEBACK": rung or ADAPTIVE_LADDER, "KVCODEC_ADAPTIVE": "0" if rung else "1",
               # the populating server stores every chunk of every prompt (a deployed one drops past 8 waiting)
               "KVCODEC_WRITEBACK_PENDING": "4096"}
        if base == "kvcodec-vllm-serve-ram":
            env.update(KVCODEC_LOCAL_STORE=f"file://{ram_tier(root.parent)}", KVCODEC_LOCAL_STORE_MB="4096")
        with VllmServe(model, root, env, one_port(), prefix_cache=prefix_cache, python=VLLM_PYTHON,
                       extra_args=LOGPROBS_ARGS) as server:
            footprint.watch("vllm", server.process.pid)
            yield server
        return
    running = contextlib.nullcontext(lmcache) if lmcache else lmcache_server(root, store, fp8=base == "lmcache-fp8")
    with running as (lm_port, lm_pid):
        footprint.watch("lmcache-server", lm_pid)
        transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": lm_port}}
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        with VllmServe(model, root, env, one_port(), connector=False, prefix_cache=prefix_cache,
                       python=LMCACHE_VENV / "bin" / "python",
                       extra_args=["--kv-transfer-config", json.dumps(transfer), *LOGPROBS_ARGS]) as server:
            footprint.watch("vllm", server.process.pid)
            yield server


# -- one method at one rate ----------------------------------------------------------------------------
def measure(server, texts: List[str], clients: int) -> List[dict]:
    """Each prompt once, ``clients`` at a time: TTFT (streamed) and the greedy answer."""
    def one(text: str) -> dict:
        return server.streamed(text, ANSWER_TOKENS)

    with ThreadPoolExecutor(max(1, clients)) as pool:
        return list(pool.map(one, texts))


@dataclass
class Reference:
    """Prefill's answers at this rate (``answers``: prompt -> greedy text) and its gate path
    (``gate``: prompt -> (token ids, greedy tokens, top-k log-probabilities at each))."""
    answers: Dict[str, str] = field(default_factory=dict)
    gate: Dict[str, tuple] = field(default_factory=dict)


def gate_row(method: str, server, texts: List[str], reference: Reference) -> Optional[dict]:
    """The quality gate (``kvcodec_tools.quality.served_gate``) of the server that has just answered
    ``texts`` (their KV loaded as the method stores it): prefill records the reference path, every
    other vLLM OpenAI row is asked along it. ``None`` for the ensemble (no log-probabilities there)."""
    from kvcodec_tools.quality import served_gate

    base, _ = method_parts(method)
    if base == "kvcodec-ensemble":
        return None
    if base == "prefill":
        for text in texts:
            ids = served_gate.tokenize(server.url, text)
            reference.gate[text] = (ids, *served_gate.reference_path(server.url, ids))
        return None
    if not reference.gate:
        return None
    tested = [served_gate.forced(server.url, reference.gate[t][0], reference.gate[t][1]) for t in texts]
    return served_gate.verdict([reference.gate[t][2] for t in texts], tested)


def run_method(method: str, rate: float, model: Path, work: Path, texts: List[str], store: PeersStore,
               config: PeersConfig, reference: Reference, log=print) -> List[dict]:
    rows = []
    footprint = Footprint()
    base, rung = method_parts(method)
    # lmcache-ram: one LMCache server for the populating and the measuring vLLM (its RAM tier)
    with (lmcache_server(work / "lmcache", store, fp8=False) if base == "lmcache-ram"
          else contextlib.nullcontext()) as shared, removed(ram_tier(work)):
        if base != "prefill":  # a first server computes every prompt and stores its KV
            with method_server(method, model, work / "populate", store, config, True, footprint, shared) as server:
                for text in texts:
                    server.completion(text, 1)
                store.settle()  # write-back / LMCache's store to L2 finishes off the request's path
        # a static rung's rows show what the ladder chooses between: one client (the first count) is enough
        for clients in (config.clients[:1] if rung else config.clients):
            before = store.sent() if base != "prefill" else 0
            # vLLM's prefix cache on (the prompts share no block: nothing of them is local, which
            # ``local_hit_tokens`` shows); the ensemble's off (its steps would fetch regardless)
            with method_server(method, model, work / f"measure-{clients}", store, config,
                               base != "kvcodec-ensemble", footprint, shared) as server:
                server.completion("Hello", 1)  # the server's one-time costs, no stored chunk
                t0 = time.monotonic()
                answers = measure(server, texts, clients)
                footprint.sample()
                wall = time.monotonic() - t0
                after = store.sent() if base != "prefill" else 0
                local = (sum(a.get("local_tokens") or 0 for a in answers) if base == "kvcodec-ensemble"
                         else server.metrics().get("vllm:prefix_cache_hits_total"))
                rungs = rung_chunks(server.metrics_text()) if base.startswith("kvcodec-vllm-serve") else None
                # LMCache's serde is the same at every rate, and its server reads the whole prefix across
                # the link for each of the gate's requests (vLLM holds it): its gate at the fastest rate
                # only, and not below 1 Gbit/s (64 reads of 189 MB at 100 Mbit/s: 17 minutes)
                gated = clients == config.clients[0] and (not base.startswith("lmcache") or (
                    rate == max(config.bandwidths) and rate >= LMCACHE_GATE_MIN_MBPS))
                gate = gate_row(method, server, texts, reference) if gated else None
            sent = after - before
            reused = sum((config.context_tokens // config.chunk_tokens) * config.chunk_tokens for _ in texts)
            ttfts = [a["ttft_s"] for a in answers]
            if base == "prefill" and clients == config.clients[0]:
                reference.answers.update({t: a["text"] for t, a in zip(texts, answers, strict=True)})
            match = ([reference.answers.get(t) == a["text"] for t, a in zip(texts, answers, strict=True)]
                     if reference.answers else [])
            row = {"method": method, "bandwidth_mbps": rate, "clients": clients, "context_tokens": config.context_tokens,
                   **summarize(ttfts), "ttfts_s": [round(x, 4) for x in ttfts],
                   "bytes_per_token": round(sent / reused, 1) if base != "prefill" and reused else None,
                   "tokens_match": all(match) if match else None, "tokens_matched": sum(match) if match else None,
                   "cached_tokens": [a.get("cached_tokens") for a in answers], "local_hit_tokens": local,
                   "gate": gate, "wall_s": round(wall, 2), "mode": MODES[base], "processes": footprint.report()}
            log(f"  {method} @ {rate:g} Mbit/s, {clients} client(s): TTFT p50 {row['ttft_p50_s']:.3f} s, "
                f"p90 {row['ttft_p90_s']:.3f} s; bytes/token {row['bytes_per_token']}; tokens match {row['tokens_match']}"
                + (f"; gate mean KL {gate['mean_kl']}, top-1 {gate['top1_agreement']}, passes {gate['passes']}"
                   if gate else ""))
            if base.startswith("kvcodec-vllm-serve"):
                row.update(rungs=rungs, costs=cost_summary(
                    work / "home" / "costs.json", config.chunk_tokens))
            rows.append(row)
    return rows


def ram_tier(work: Path) -> Path:
    """The RAM folder of a method's local tier (``kvcodec-vllm-serve-ram``), one per method and rate."""
    return Path("/dev/shm") / f"kvcodec-peers-{zlib.crc32(str(work.resolve()).encode()):08x}"


@contextlib.contextmanager
def removed(path: Path) -> Iterator[None]:
    """``path`` is removed after the block (and before: a stopped run's left-overs)."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rung_chunks(metrics_text: str) -> Dict[str, int]:
    """Chunks read per rung (``kvcodec_rung_chunks_total``'s ``rung`` label) in Prometheus text."""
    from kvcodec_tools.services.vllm_serve import by_label

    return by_label(metrics_text, "kvcodec_rung_chunks_total", "rung")


def cost_summary(path: Path, chunk_tokens: int) -> Optional[dict]:
    """The cost model's inputs in ``path`` per chunk of ``chunk_tokens``: per rung (named as the ladder
    names it) MB, decode and restore seconds; per link MB/s; None when there is no file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rungs = {}
    for identity, r in data.get("rungs", {}).items():
        rungs[identity.split("/", 1)[0]] = {
            "mb": round(r.get("bytes_per_token", 0) * chunk_tokens / 1e6, 3),
            "decode_s": round(r.get("decode_s_per_token", 0) * chunk_tokens, 4),
            "restore_s": round(r.get("restore_s_per_token", 0) * chunk_tokens, 4)}
    links = [round(1e-6 / link["s_per_byte"], 1) for link in data.get("links", {}).values() if link.get("s_per_byte")]
    return {"per_chunk": rungs, "link_mb_per_s": links}


MODES = {"prefill": "vLLM multiprocess", "lmcache": "vLLM multiprocess (LMCacheMPConnector)",
         "lmcache-fp8": "vLLM multiprocess (LMCacheMPConnector)",
         "lmcache-ram": "vLLM multiprocess (LMCacheMPConnector), one lmcache server for both vLLMs (its RAM tier)",
         "kvcodec-vllm-serve": "vLLM in the server's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
         "kvcodec-vllm-serve-ram": "vLLM in the server's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), a local tier in "
                                   "/dev/shm for both servers (KVCODEC_LOCAL_STORE)",
         "kvcodec-ensemble": "vLLM in the llm step's python stub (Triton ensemble, gRPC streaming)"}


def run_peers(config: PeersConfig, json_path: Path, plot_path: Optional[Path], work: Path) -> int:
    from kvcodec.engines.gguf import ensure_model
    from kvcodec.engines.tokenizer import Tokenizer

    for method in config.methods:
        method_parts(method)
    if any(m.startswith("lmcache") for m in config.methods) and not (LMCACHE_VENV / "bin" / "lmcache").exists():
        raise SystemExit("kvcodec bench peers: LMCache's venv is missing: make setup-lmcache")
    files = ensure_model(REPO / ".cache" / "models")
    texts = prompts(Tokenizer(files), config)
    rows: List[dict] = []
    for rate in config.bandwidths:
        reference = Reference()
        methods = sorted(config.methods, key=lambda m: m != "prefill")  # prefill first: the reference tokens
        for method in methods:
            print(f"[{rate:g} Mbit/s] {method}", flush=True)
            try:
                with store_behind_link(work, rate, config) as (store, link):
                    rows += run_method(method, rate, files.path, work / f"{rate:g}" / method.replace(":", "-"),
                                       texts, store, config, reference)
                    link_info = dict(link.describe(), store=store.kind)
                rows[-1]["link"] = link_info
            except Exception as exc:  # one method's failure is its row; the others still run
                print(f"  {method} @ {rate:g} Mbit/s failed: {type(exc).__name__}: {exc}", flush=True)
                rows.append({"method": method, "bandwidth_mbps": rate, "clients": None,
                             "context_tokens": config.context_tokens, "ttft_p50_s": None, "ttft_p90_s": None,
                             "bytes_per_token": None, "tokens_match": None,
                             "error": f"{type(exc).__name__}: {exc}"[:500]})
            write(rows, config, json_path)  # after each method: a run stopped later keeps what it measured
    if plot_path:
        plot(rows, plot_path)
    return 0


def write(rows: List[dict], config: PeersConfig, path: Path) -> None:
    """``rows`` into ``path``, keeping the rows already there of (method, rate) pairs not run now."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ran = {(r["method"], r["bandwidth_mbps"]) for r in rows}
    try:
        kept = [r for r in json.loads(path.read_text())["rows"] if (r["method"], r["bandwidth_mbps"]) not in ran]
    except (OSError, ValueError, KeyError):
        kept = []
    rows = sorted(kept + rows, key=lambda r: (r["bandwidth_mbps"], METHODS.index(method_parts(r["method"])[0]),
                                              r["method"], r["clients"] or 0))
    path.write_text(json.dumps({"rows": rows, "config": asdict(config), "model": "SmolLM2-135M-Instruct, float32",
                                "machine": f"{os.cpu_count()} CPU cores", "python": sys.version.split()[0]},
                               indent=2) + "\n")


def plot(rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.6, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r["bandwidth_mbps"], r["ttft_p50_s"]) for r in rows if r["method"] == method and r["clients"] == 1)
        if points:
            ax.plot(*zip(*points, strict=True), "o-", label=method)
    ax.set_xscale("log")
    ax.set_xlabel("link rate to Redis (Mbit/s)")
    ax.set_ylabel("TTFT p50 (s), one client")
    ax.set_title("KVCodec and LMCache on vLLM (CPU), same store, same link")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(sub) -> None:
    """``kvcodec bench peers`` under ``kvcodec bench``'s subcommands ``sub``."""
    from kvcodec_tools.cli import _list

    p = sub.add_parser("peers", help="this project against LMCache on vLLM: same model, texts, Redis and link")
    p.add_argument("--bandwidth-mbps", type=_list(float), default=[100.0, 1000.0, 10000.0])
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--contexts", type=int, default=4)
    p.add_argument("--clients", type=_list(int), default=[1, 4])
    p.add_argument("--methods", type=_list(str), default=PeersConfig().methods,
                   help=f"{', '.join(METHODS)}; kvcodec-vllm-serve:RUNG for one static rung")
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--link-mode", choices=["auto", "netns", "userspace"], default="auto")
    p.add_argument("--json", default=str(RESULTS))
    p.add_argument("--plot", default=None, help="the plot (default: --json's path with .png; \"\": none)")
    p.add_argument("--store", choices=STORES, default="redis",
                   help="the store behind the link: Redis, or SeaweedFS's S3 (LMCache's s3 adapter; netns links)")
    p.add_argument("--work", default=str(REPO / ".cache" / "peers"))
    p.set_defaults(func=lambda a: run_peers(
        PeersConfig(a.bandwidth_mbps, a.context_tokens, a.contexts, a.clients, a.methods, a.delay_ms, a.link_mode,
                    store=a.store),
        Path(a.json), Path(a.json).with_suffix(".png") if a.plot is None else Path(a.plot) if a.plot else None,
        Path(a.work)))
