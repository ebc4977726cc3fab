"""``kvcodec soak --chaos``: several servers under load while the store, the link, the stubs and the
decoders fail at random moments, overlapping; every answer checked against the model's own.

1. A real store (``--chaos-store``: nginx (default), redis, redis-cluster with replicas, s3) behind
   the misbehaving proxy (``chaos_faults.ChaosStore``); ``contexts`` contexts ingested at ``raw`` (the
   ``reuse`` prompts) and as many others at ``lossless8`` only (the ``decoded`` prompts: the HEVC rung
   that kv_decode's decoder process decodes).
2. ``servers`` tritonservers (the vLLM engine where it is installed, else transformers), each under
   the watchdog ``kvcodec serve`` runs (a dead stub restarts the server), one chunk key, behind the
   nginx balancer; ladder ``raw,lossless8``, write-back ``raw``, the adaptive fetcher on, vLLM's
   prefix cache off (every reuse crosses the store). No request names its rungs (a request that
   does is held to ``fetch_timeout_s`` only, as a benchmark's baseline asks).
3. References, each prompt alone through one server: prefill's answer for every prompt (reuse at a
   lossless rung gives exactly that), and for the ``decoded`` prompts the answer at each number of
   reused chunks (chunks taken out of the store from the tail, one at a time, then put back). An
   answer equal to the prompt's prefill is always right (a decoded prompt's raw copy, written back
   after a miss, gives it); any other must equal the reference with the same reuse.
4. ``clients`` clients through the balancer (half gRPC, half HTTP) ask the mix of
   ``chaos_plan.PROMPT_KINDS`` for ``duration_s``, with the client library's fallback (a failure
   of the server is asked again, without reuse, for up to ``fallback_s``); a churn thread deletes
   the write-back and partial prompts' own chunks every few seconds so that they keep missing and
   writing back. Meanwhile the faults of ``chaos_plan.schedule`` run, one thread per target, and a
   sampler reads every server's process tree (RSS, threads, fds, sockets, processes).
5. Then every chunk in the store is read and verified with the chunk key (``container.parse``).

The verdict: 0 wrong answers (an answer differing from the reference with the same reuse), 0 lost
requests (no answer within the fallback), 0 corrupt chunks stored, every fault healed, and flat
resources (``soak.growth`` per server, over samples where the server was whole); answers past the
TTFT bound (``chaos_plan.ttft_bounds``) are counted (``over_bound``), reuse coming back after each
heal is timed (``reuse_back_s``). JSON (default perf/results/chaos.json) and a timeline plot.
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .chaos_faults import ChaosStore, FaultRecord, Rig, inject
from .chaos_plan import (
    DECODED_RUNG,
    PROMPT_KINDS,
    STORE_KINDS,
    Answer,
    Fault,
    check,
    mix,
    reuse_back,
    schedule,
)
from .chaos_verdict import plot, summarize
from .soak_prompts import QUESTION, context_ids

LADDER = ("raw", DECODED_RUNG)  # the servers': raw where stored, else the decoded rung
CHURN_S = 4.0


@dataclass
class ChaosConfig:
    servers: int = 2
    clients: int = 8
    duration_s: float = 300.0
    store: str = "nginx"
    faults: Tuple[str, ...] = ()  # () : every fault the store allows (disk-full only as root)
    seed: int = 0
    mean_gap_s: float = 20.0
    protocols: Tuple[str, ...] = ("grpc", "http")
    contexts: int = 2
    context_tokens: int = 600
    max_tokens: int = 8
    threads: int = 1
    sample_s: float = 5.0
    warmup_s: float = 30.0
    window_s: float = 60.0
    fallback_s: float = 300.0
    request_timeout_s: float = 300.0
    disk_mb: int = 512

    def __post_init__(self) -> None:
        self.protocols, self.faults = tuple(self.protocols), tuple(self.faults)
        if self.store not in STORE_KINDS:
            raise ValueError(f"--chaos-store must be one of {', '.join(STORE_KINDS)}, got {self.store}")
        if not self.faults:
            self.faults = tuple(k for k in STORE_KINDS[self.store] if k != "disk-full" or os.geteuid() == 0)
        bad = [k for k in self.faults if k not in STORE_KINDS[self.store]]
        if bad:
            raise ValueError(f"fault(s) {', '.join(bad)} not with store {self.store} "
                             f"(it allows {', '.join(STORE_KINDS[self.store])})")
        if "disk-full" in self.faults and os.geteuid() != 0:
            raise ValueError("disk-full mounts a tmpfs under the store: run as root, or leave it out of --faults")
        if self.servers < 1 or self.clients < 1 or self.contexts < 1 or self.max_tokens < 1:
            raise ValueError("servers, clients, contexts and max_tokens must be >= 1")
        if self.contexts > 2:
            raise ValueError("contexts must be at most 2 (each prompt kind takes its own texts)")
        if not self.protocols or any(p not in ("grpc", "http") for p in self.protocols):
            raise ValueError(f"protocols must be grpc and/or http, got {','.join(self.protocols)}")
        if self.duration_s <= 0 or self.mean_gap_s <= 0 or self.fallback_s <= 0:
            raise ValueError("duration_s, mean_gap_s and fallback_s must be > 0")


def default_engine() -> str:
    """vLLM where it is installed (the engine to serve traffic with), else transformers."""
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") else "transformers"


# -- prompts ----------------------------------------------------------------------------------------
@dataclass
class Prompts:
    ids: Dict[str, List[int]]  # name -> token ids
    kind: Dict[str, str]  # name -> one of PROMPT_KINDS
    churn: Dict[str, List[int]]  # name -> ids whose raw chunks the churn thread deletes (from chunk ``first``)
    churn_first: Dict[str, int]
    question_tokens: int
    churn_keys: List[str] = field(default_factory=list)  # their raw chunks' keys (``with_churn_keys``)

    def of(self, kind: str) -> List[str]:
        return [n for n, k in self.kind.items() if k == kind]


def make_prompts(tokenizer, question: List[int], contexts: int, context_tokens: int, chunk: int) -> Prompts:
    """Every kind's prompts from disjoint standard-library texts (``soak_prompts.context_ids``)."""
    ids, kind, churn, first = {}, {}, {}, {}
    for i in range(contexts):
        ctx = context_ids(tokenizer, context_tokens, i)
        for k in ("reuse", "prefill"):
            ids[f"{k}{i}"], kind[f"{k}{i}"] = ctx + question, k
        ids[f"decoded{i}"], kind[f"decoded{i}"] = context_ids(tokenizer, context_tokens, 4 * contexts + i) + question, \
            "decoded"
        churn[f"decoded{i}"], first[f"decoded{i}"] = ids[f"decoded{i}"], 0  # its raw copies written back
        tail = context_ids(tokenizer, max(chunk, context_tokens - chunk), 2 * contexts + i)
        ids[f"partial{i}"], kind[f"partial{i}"] = ctx[:chunk] + tail + question, "partial"
        churn[f"partial{i}"], first[f"partial{i}"] = ids[f"partial{i}"], 1
        ids[f"writeback{i}"], kind[f"writeback{i}"] = context_ids(tokenizer, context_tokens, contexts + i) + question, \
            "writeback"
        churn[f"writeback{i}"], first[f"writeback{i}"] = ids[f"writeback{i}"], 0
        miss = context_ids(tokenizer, chunk // 3, 3 * contexts + i)[: chunk // 2]
        ids[f"miss{i}"], kind[f"miss{i}"] = miss + question, "miss"
    return Prompts(ids, kind, churn, first, len(question))


def contexts_of(prompts: Prompts) -> Dict[str, Tuple[List[int], str]]:
    """{prompt name: (its context, the rung ingest stores it at)}: the ``reuse`` prompts' at raw, the
    ``decoded`` prompts' at the decoded rung only (so that the server's ladder reads them through
    kv_decode's decoder process without the request naming a rung)."""
    return {n: (prompts.ids[n][: len(prompts.ids[n]) - prompts.question_tokens],
                "raw" if prompts.kind[n] == "reuse" else DECODED_RUNG)
            for n in prompts.ids if prompts.kind[n] in ("reuse", "decoded")}


# -- the run ------------------------------------------------------------------------------------------
def run_chaos(settings, repository: Path, config: ChaosConfig, json_path: Path, plot_path: Optional[Path]) -> int:
    from kvcodec.engines import open_engine
    from kvcodec.ingest import ingest_rungs

    from .remote_store import new_store_token

    work = settings.home / "chaos"
    work.mkdir(parents=True, exist_ok=True)
    settings = replace(settings, threads=config.threads, key_file=work / "chunk.key")
    store = ChaosStore(config.store, work / "store", new_store_token(),
                       disk_mb=config.disk_mb if "disk-full" in config.faults else 0)
    saved_env = dict(os.environ)
    doc: dict = {}
    try:
        store.start()
        os.environ.update(store.server_environ())  # the servers (and their restarts) inherit it
        print(f"store {config.store}: servers use {store.server_url}"
              f"{' (through the fault proxy)' if store.proxy else ''}", flush=True)
        engine = open_engine(replace(settings, store=store.direct_url))
        question = engine.tokenize(QUESTION)
        prompts = make_prompts(engine.tokenizer, question, config.contexts, config.context_tokens,
                               settings.chunk_tokens)
        for name, (ctx, rung) in contexts_of(prompts).items():
            print(f"ingest {name}: {len(ctx)} tokens at {rung}", flush=True)
            ingest_rungs(settings, engine, ctx, [rung], store_url=store.direct_url, threads=config.threads)
        if hasattr(engine, "close"):
            engine.close()
        del engine
        doc = _serve_and_load(settings, repository, config, store, prompts)
    finally:
        store.stop()
        os.environ.clear()
        os.environ.update(saved_env)
    return _report(doc, config, settings.engine, json_path, plot_path)


def _serve_and_load(settings, repository: Path, config: ChaosConfig, store: ChaosStore, prompts: Prompts) -> dict:
    from kvcodec.format.auth import auth_for
    from kvcodec_tools.tritonserver import Ports, TritonServer
    from kvcodec_tools.watchdog import Watchdog

    from .ports import free_ports
    from .services.balancer import Balancer

    work = settings.home / "chaos"
    prompts = with_churn_keys(settings, prompts)
    base = replace(settings, store=store.server_url, ladder=LADDER, writeback=("raw",), adaptive=True,
                   prefix_cache=False)
    servers = [TritonServer(repository, replace(base, home=work / f"server{i}"), Ports(*free_ports(3)),
                            log_path=work / f"server{i}" / "tritonserver.log") for i in range(config.servers)]
    watchdogs: list = []
    balancer = None
    auth = auth_for(settings)
    try:
        for i, server in enumerate(servers):  # one at a time: two model loads at once on 2 cores thrash
            print(f"starting server {i} ({settings.engine}) ...", flush=True)
            server.start(timeout_s=900)
        watchdogs = [Watchdog(s, start_timeout_s=900).start() for s in servers]
        http_port, grpc_port = free_ports(2)
        balancer = Balancer(work / "balancer", "127.0.0.1", http_port, grpc_port,
                            [(s.ports.http, s.ports.grpc) for s in servers], timeout_s=config.request_timeout_s).start()
        references, alone, full, ref_failures = _references(servers, store, prompts, settings, config)
        plan = schedule(config.faults, config.duration_s, config.seed, config.mean_gap_s)
        print(f"{len(references)} references; {len(plan)} faults planned "
              f"({', '.join(f'{k} x{n}' for k, n in Counter(f.kind for f in plan).items())}); "
              f"{config.clients} clients for {config.duration_s:g} s through the balancer ...", flush=True)
        rig = Rig(store, servers, watchdogs, random.Random(config.seed + 1))
        answers, records, samples, wall_s, churn_errors = (
            _load(balancer, rig, prompts, references, plan, config) if not ref_failures
            else ([], [], [], 0.0, 0))
        corrupt, stored, verify_errors = _verify_store(store, auth)
        restarts = [w.restarts for w in watchdogs]
    finally:
        for w in watchdogs:
            w.stop(60)
        if balancer is not None:
            balancer.stop()
        for s in servers:
            s.stop()
    for r in records:
        r.reuse_back_s = reuse_back(answers, r.healed_s, full)
    return {"references": references, "alone": alone, "full": full, "reference_failures": ref_failures,
            "answers": answers, "faults": records, "plan": plan, "samples": samples, "wall_s": wall_s,
            "corrupt": corrupt, "stored": stored, "verify_errors": verify_errors, "restarts": restarts,
            "churn_errors": churn_errors, "prompt_tokens": {n: len(v) for n, v in prompts.ids.items()}}


def _raw_keys(settings, ids: Sequence[int], rung: str = "raw") -> List[str]:
    from kvcodec.engines import model_card
    from kvcodec.format.codecs import get_scheme
    from kvcodec.format.keys import chunk_keys

    card = model_card(settings)
    return chunk_keys(ids, card.model_id, get_scheme(rung).for_card(card).identity, settings.chunk_tokens)


def with_churn_keys(settings, prompts: Prompts) -> Prompts:
    """``prompts`` with the keys of the raw chunks the churn deletes (computed once: model card, hashes)."""
    keys = [key for name, ids in prompts.churn.items() for key in _raw_keys(settings, ids)[prompts.churn_first[name]:]]
    return replace(prompts, churn_keys=keys)


def _churn(store_handle, prompts: Prompts) -> int:
    """Delete the write-back and partial prompts' own chunks; the deletes that failed."""
    failed = 0
    for key in prompts.churn_keys:
        try:
            store_handle.delete(key)
        except Exception:  # noqa: BLE001 - the store may be down: that is the point
            failed += 1
    return failed


def _references(servers, store: ChaosStore, prompts: Prompts, settings, config: ChaosConfig):
    """(references {(name, reused): tokens}, alone prefill TTFT {name: s}, full reuse {name: tokens},
    failures), every prompt asked alone through server 0 (each server warmed up first)."""
    from kvcodec.store import open_store
    from kvcodec_client.client import KVCodecClient

    refs: Dict[Tuple[str, int], List[int]] = {}
    alone: Dict[str, float] = {}
    full: Dict[str, int] = {}
    failures: List[str] = []
    for s in servers:
        warm = KVCodecClient(s.grpc_url, "grpc", config.request_timeout_s)
        for name, reuse in ((prompts.of("reuse")[0], False), (prompts.of("reuse")[0], True),
                            (prompts.of("decoded")[0], True)):
            warm.generate(prompts.ids[name], config.max_tokens, reuse=reuse)
    client = KVCodecClient(servers[0].grpc_url, "grpc", config.request_timeout_s)
    handle = open_store(store.direct_url)
    try:
        _churn(handle, prompts)
        for name, ids in prompts.ids.items():
            kind = prompts.kind[name]
            pre = client.generate(ids, config.max_tokens, reuse=False)
            alone[name] = round(pre.ttft_s, 4)
            if kind != "decoded":
                refs[name, -1] = pre.tokens  # prefill, and reuse at a lossless rung: the same answer
                if kind == "reuse":
                    r = client.generate(ids, config.max_tokens, reuse=True)
                    full[name] = r.reused_tokens
                    if r.reused_tokens <= 0 or r.tokens != pre.tokens:
                        failures.append(f"{name}: raw reuse of {r.reused_tokens} tokens gave {r.tokens}, "
                                        f"prefill {pre.tokens} ({r.stats.get('miss_reason', '')})")
                continue
            refs[name, 0] = pre.tokens
            keys = _raw_keys(settings, ids[: len(ids) - prompts.question_tokens], DECODED_RUNG)
            kept = {k: handle.get(k) for k in keys}
            try:
                for n in range(len(keys), 0, -1):  # n chunks stored: the answer at each reuse
                    _churn(handle, prompts)  # the raw copies the last ask wrote back
                    r = client.generate(ids, config.max_tokens, reuse=True)
                    refs[name, r.reused_tokens] = r.tokens
                    if n == len(keys):
                        full[name] = r.reused_tokens
                        if r.reused_tokens <= 0:
                            failures.append(f"{name}: {DECODED_RUNG} reused nothing ({r.stats.get('miss_reason')})")
                    handle.delete(keys[n - 1])
            finally:
                for k, data in kept.items():
                    if data is not None:
                        handle.put(k, data)
        _churn(handle, prompts)
    finally:
        handle.close()
    print(f"references: {len(refs)} answers; prefill alone {min(alone.values()):.2f}-{max(alone.values()):.2f} s; "
          f"full reuse {full}; failures {failures}", flush=True)
    return refs, alone, full, failures


def _load(balancer, rig: Rig, prompts: Prompts, references, plan: List[Fault], config: ChaosConfig):
    from kvcodec.store import open_store
    from kvcodec_client.client import ClientError, KVCodecClient

    from .procstats import sample_tree

    answers: List[Answer] = []
    records: List[FaultRecord] = []
    samples: List[dict] = []
    lock = threading.Lock()
    done = threading.Event()
    counts = {k: len(prompts.of(k)) for k in PROMPT_KINDS}
    cycle = mix(counts)
    t0 = time.monotonic()
    deadline = t0 + config.duration_s

    def clock() -> float:
        return time.monotonic() - t0

    def client_loop(c: int) -> None:
        protocol = config.protocols[c % len(config.protocols)]
        client = KVCodecClient(balancer.grpc_url if protocol == "grpc" else balancer.http_url, protocol,
                               config.request_timeout_s, fallback_s=config.fallback_s)
        j = c * 3
        while time.monotonic() < deadline:
            kind, index = cycle[j % len(cycle)]
            j += 1
            name = f"{kind}{index}"
            a = Answer(c, kind, name, clock(), 0.0)
            try:
                r = client.generate(prompts.ids[name], config.max_tokens, reuse=kind != "prefill")
                a.end_s = clock()
                a.ttft_s = round((a.end_s - a.start_s) - (r.total_s - r.ttft_s), 4)
                a.tokens, a.reused_tokens, a.attempts = r.tokens, r.reused_tokens, 1 + len(r.failures)
                a.miss_reason = str(r.stats.get("miss_reason", ""))[:200]
            except (ClientError, OSError) as exc:
                a.end_s, a.error = clock(), f"{type(exc).__name__}: {exc}"[:400]
            a.verdict = check(a, references)
            with lock:
                answers.append(a)

    def fault_loop(faults: List[Fault]) -> None:
        for f in faults:
            while clock() < f.at_s and not done.is_set():
                time.sleep(0.1)
            if done.is_set():
                return
            try:
                rec = inject(f, rig, clock, done.is_set)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be done or undone: unhealed
                rec = FaultRecord(f.kind, clock(), None, f.hold_s, f"error: {type(exc).__name__}: {exc}"[:300])
            print(f"[{clock():6.0f} s] fault {rec.kind} at {rec.at_s:.0f} s healed "
                  f"{'never' if rec.healed_s is None else f'{rec.healed_s:.0f} s'} {rec.detail}", flush=True)
            with lock:
                records.append(rec)

    churn_errors = [0]

    def churn_loop() -> None:
        handle = open_store(rig.store.direct_url)
        try:
            while not done.wait(CHURN_S):
                churn_errors[0] += _churn(handle, prompts)
        finally:
            handle.close()

    def sample_loop() -> None:
        while not done.is_set():
            t = round(clock(), 2)
            for i, s in enumerate(rig.servers):
                pid = s.pid
                if pid:
                    samples.append({"t_s": t, "server": i, "ready": s.ready(), **sample_tree(pid)})
            with lock:
                n, bad = len(answers), Counter(a.verdict for a in answers)
            rss = "/".join(f"{x['rss_bytes'] / 2**20:.0f}" for x in samples if x["t_s"] == t)
            print(f"[{t:6.0f} s] {n} answers ({dict(bad)}); faults done {len(records)}; RSS {rss} MiB", flush=True)
            done.wait(config.sample_s)

    by_target: Dict[str, List[Fault]] = defaultdict(list)
    for f in plan:
        by_target[f.target].append(f)
    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True, name=f"chaos-client{c}")
               for c in range(config.clients)]
    threads += [threading.Thread(target=fault_loop, args=(fs,), daemon=True, name=f"chaos-{t}")
                for t, fs in by_target.items()]
    helpers = [threading.Thread(target=churn_loop, daemon=True, name="chaos-churn"),
               threading.Thread(target=sample_loop, daemon=True, name="chaos-sampler")]
    for t in threads + helpers:
        t.start()
    for t in threads:  # clients end at the deadline (their last request may run on); faults heal first
        t.join(config.duration_s + config.fallback_s + config.request_timeout_s + 120)
    wall_s = clock()
    done.set()
    for t in helpers:
        t.join(60)
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        print(f"still running at the end: {stuck}", flush=True)
    return sorted(answers, key=lambda a: a.start_s), sorted(records, key=lambda r: r.at_s), samples, wall_s, \
        churn_errors[0]


def _verify_store(store: ChaosStore, auth) -> Tuple[int, int, List[str]]:
    """(chunks failing verification, chunks stored, the first errors): every chunk read and parsed."""
    from kvcodec.errors import ChunkError
    from kvcodec.format.container import parse
    from kvcodec.store import open_store

    corrupt, stored, errors = 0, 0, []
    with open_store(store.direct_url) as handle:
        for entry in handle.scan():
            data = handle.get(entry.key)
            if data is None:
                continue  # deleted meanwhile
            stored += 1
            try:
                parse(data, auth)
            except ChunkError as exc:
                corrupt += 1
                errors.append(f"{entry.key}: {exc}"[:300])
    print(f"store: {stored} chunks, {corrupt} fail verification", flush=True)
    return corrupt, stored, errors[:10]


def _report(doc: dict, config: ChaosConfig, engine: str, json_path: Path, plot_path: Optional[Path]) -> int:
    if not doc:
        return 1
    result = {"engine": engine, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpu_count": os.cpu_count(), "config": asdict(config), **summarize(doc, config),
              "answers": [[round(a.start_s, 2), a.prompt, a.ttft_s, a.reused_tokens, a.attempts, a.verdict]
                          for a in doc["answers"]],
              "answers_columns": ["start_s", "prompt", "ttft_s", "reused_tokens", "attempts", "verdict"],
              "resource_series": doc["samples"]}
    failures = []
    for key in ("wrong_answers", "lost_requests", "corrupt_chunks_stored", "faults_unhealed"):
        if result[key]:
            failures.append(f"{key} {result[key]}")
    if result["reference_failures"]:
        failures.append(f"reference failures {result['reference_failures']}")
    if not result["resources"]["flat"]:
        failures.append("resources not flat: " + "; ".join(
            f"server {i}: {', '.join(v['not_flat'])}" for i, v in result["resources"]["growth"].items() if not v["flat"]))
    if not doc["faults"]:
        failures.append("no fault ran")
    result["ok"], result["failures"] = not failures, failures
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {json_path}")
    if plot_path:
        plot(result, plot_path)
        print(f"wrote {plot_path}")
    print(json.dumps({k: result[k] for k in ("requests", "wrong_answers", "lost_requests", "corrupt_chunks_stored",
                                             "over_bound", "faults_unhealed", "faults_reuse_not_back", "restarts")}))
    if failures:
        print("CHAOS FAILED: " + "; ".join(failures))
        return 1
    return 0
