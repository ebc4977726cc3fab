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
import secrets
import shutil
import socket
import statistics
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
LMCACHE_VENV = REPO / ".venv-lmcache"
RESULTS = REPO / "perf" / "results" / "peers.json"
METHODS = ("prefill", "lmcache", "lmcache-fp8", "lmcache-ram", "kvcodec-vllm-serve", "kvcodec-vllm-serve-ram",
           "kvcodec-ensemble")
LOCAL_TIERS = ("lmcache-ram", "kvcodec-vllm-serve-ram")  # asked for by name: a tier on the machine, not the link
KVCODEC = ("kvcodec-vllm-serve", "kvcodec-ensemble")
SOURCES = ("argparse.py", "typing.py", "inspect.py", "pathlib.py", "ast.py", "enum.py", "subprocess.py", "tarfile.py")
QUESTION = "\n\n# Question: what does the code above do?\n# Answer:"
ANSWER_TOKENS = 8
# the adaptive rows' ladder: stored at every rung by write-back, chosen per chunk over the measured link
ADAPTIVE_LADDER = "kvtc-w,int8-zstd,raw"
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


# -- processes: CPU seconds and peak RSS -----------------------------------------------------------
class Footprint:
    """CPU seconds (user + system) and peak RSS of process trees, sampled while a method runs."""

    def __init__(self) -> None:
        self.roots: Dict[str, int] = {}
        self.peak_rss: Dict[str, int] = {}
        self.cpu_s: Dict[str, float] = {}

    def watch(self, name: str, pid: Optional[int]) -> None:
        if pid:
            self.roots[name] = pid

    def sample(self) -> None:
        from kvcodec_tools.procstats import descendants

        tick = os.sysconf("SC_CLK_TCK")
        for name, root in self.roots.items():
            rss, cpu = 0, 0.0
            for pid in [root, *descendants(root)]:
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    cpu += (int(fields[11]) + int(fields[12])) / tick
                    rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                except (OSError, IndexError, ValueError):
                    continue
            self.peak_rss[name] = max(self.peak_rss.get(name, 0), rss)
            self.cpu_s[name] = max(self.cpu_s.get(name, 0.0), round(cpu, 2))

    def report(self) -> Dict[str, dict]:
        return {n: {"cpu_s": self.cpu_s.get(n, 0.0), "peak_rss_mb": round(self.peak_rss.get(n, 0) / 2**20, 1)}
                for n in self.roots}


# -- the store behind the link ------------------------------------------------------------------------
@dataclass
class PeersStore:
    """One store behind the link, as every method sees it: KVCodec's ``url`` (and ``env``, the
    variables its servers need), LMCache's L2 ``adapter``, ``sent()`` (bytes the store has sent so
    far) and ``settle()`` (returns once the writes off the requests' path are done)."""

    kind: str
    url: str
    adapter: dict
    env: Dict[str, str]
    sent: Callable[[], int]
    settle: Callable[[], None]


@contextlib.contextmanager
def store_behind_link(root: Path, rate: float, config: PeersConfig) -> Iterator[Tuple[PeersStore, object]]:
    """``config.store``'s server (``redis``: Redis; ``s3``: SeaweedFS's S3) behind a new shaped link."""
    from kvcodec_tools.shaping import open_link

    with open_link(rate, config.delay_ms, config.link_mode) as link:
        opened = redis_store(root, rate, link) if config.store == "redis" else s3_store(root, rate, link)
        with opened as store:
            yield store, link


@contextlib.contextmanager
def redis_store(root: Path, rate: float, link) -> Iterator[PeersStore]:
    from kvcodec_tools.ports import free_ports
    from kvcodec_tools.services.redis import RedisServer

    password = secrets.token_hex(12)
    (port,) = free_ports(1)
    with RedisServer(root / f"redis-{rate:g}", link.server_host, port, password, wrap=link.wrap):
        host, exposed = link.expose(port)
        address = (host, exposed)
        yield PeersStore("redis", f"redis://:{password}@{host}:{exposed}/0",
                         {"type": "resp", "host": host, "port": exposed, "password": password}, {},
                         lambda: redis_info(address, password).get("total_net_output_bytes", 0),
                         lambda: settle(lambda: redis_info(address, password).get("keys", 0)))


S3_DOMAIN = "s3.peers.test"  # LMCache's S3 adapter addresses buckets virtual-hosted only: <bucket>.<domain>
S3_BUCKET = "kvpeers"


@contextlib.contextmanager
def s3_store(root: Path, rate: float, link) -> Iterator[PeersStore]:
    """SeaweedFS's S3 gateway in the link's namespace (netns links only: the bytes it sends are the
    veth's), virtual-hosted buckets on, ``<bucket>.<S3_DOMAIN>`` in /etc/hosts."""
    from kvcodec_tools.services.seaweedfs import SeaweedS3

    veth = getattr(link, "veth", None)
    if not veth:
        raise SystemExit("kvcodec bench peers --store s3 needs a netns link (root): the bytes S3 sends are the veth's")
    from kvcodec_tools.ports import free_port_run
    from kvcodec_tools.services.seaweedfs import PORTS

    key, secret = "peers-" + secrets.token_hex(4), secrets.token_hex(16)
    base = free_port_run(len(PORTS), offsets=(0, 10000))  # probed here: the namespace's ports are as free
    with SeaweedS3(root / f"s3-{rate:g}", link.server_host, key, secret, bucket=S3_BUCKET, prefix="kv",
                   base_port=base, wrap=link.wrap, domain=S3_DOMAIN).start(timeout_s=120) as weed:
        host, exposed = link.expose(weed.port)
        resolve(f"{S3_BUCKET}.{S3_DOMAIN}", host)
        env = dict(weed.environ(), AWS_ENDPOINT_URL_S3=f"http://{host}:{exposed}")
        received = Path(f"/sys/class/net/{veth[0]}/statistics/rx_bytes")  # host side: what the store sent
        sent = lambda: int(received.read_text())  # noqa: E731
        yield PeersStore("s3", weed.url, {"type": "s3", "s3_endpoint": f"{S3_BUCKET}.{S3_DOMAIN}:{exposed}",
                                          "s3_region": "us-east-1", "disable_tls": True,
                                          "aws_access_key_id": key, "aws_secret_access_key": secret},
                         env, sent, lambda: settle(sent))


def resolve(name: str, address: str, hosts: Path = Path("/etc/hosts")) -> None:
    """``name`` resolves to ``address``: a line in ``hosts`` (added when missing; root)."""
    line = f"{address} {name}"
    text = hosts.read_text()
    if any(row.split()[:2] == [address, name] for row in text.splitlines() if row.strip()):
        return
    try:
        hosts.write_text(text.rstrip("\n") + f"\n{line}\n")
    except OSError as exc:
        raise SystemExit(f"kvcodec bench peers --store s3: add '{line}' to {hosts} ({exc.strerror})") from None


def redis_info(address: Tuple[str, int], password: str) -> Dict[str, int]:
    """``INFO`` counters of the Redis server (bytes sent, keys) over RESP, no client library."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(f"*2\r\n$4\r\nAUTH\r\n${len(password)}\r\n{password}\r\n*1\r\n$4\r\nINFO\r\n".encode())
        data = b""
        while b"total_net_output_bytes" not in data or not data.endswith(b"\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    out = {}
    for line in data.decode(errors="replace").splitlines():
        name, _, value = line.partition(":")
        if name in ("total_net_output_bytes", "total_net_input_bytes") and value.strip().isdigit():
            out[name] = int(value)
        if name.startswith("db0") and "keys=" in value:
            out["keys"] = int(value.split("keys=")[1].split(",")[0])
    return out


def settle(count: Callable[[], int], quiet_s: float = 8.0, limit_s: float = 600.0) -> int:
    """Wait until ``count()`` (the store's keys, or the bytes it has moved) stops changing for
    ``quiet_s`` (the stores off the request's path are done); the count."""
    deadline, last, since = time.monotonic() + limit_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count()
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(1.0)
    return last


# -- the methods' servers ----------------------------------------------------------------------------
def _port() -> int:
    from kvcodec_tools.ports import free_ports

    return free_ports(1)[0]


# the vLLM OpenAI servers answer the gate's top-k log-probabilities
LOGPROBS_ARGS = ["--max-logprobs", "5000"]


@contextlib.contextmanager
def method_server(method: str, model: Path, root: Path, store: PeersStore, config: PeersConfig, prefix_cache: bool,
                  footprint: Footprint, lmcache: Optional[Tuple[int, int]] = None) -> Iterator[object]:
    """The method's server (and LMCache's server, unless ``lmcache`` (its port, pid) is one already
    running), ready: vLLM's OpenAI server, or the Triton ensemble behind ``EnsembleServer``'s two calls."""
    from kvcodec_tools.services.vllm_serve import VllmServe

    base, rung = method_parts(method)
    root.mkdir(parents=True, exist_ok=True)
    if base == "prefill":
        with VllmServe(model, root, {}, _port(), connector=False, prefix_cache=prefix_cache,
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
               "KVCODEC_CHUNK_KEY": _chunk_key(root.parent), "KVCODEC_LADDER": rung or ADAPTIVE_LADDER,
               "KVCODEC_WRITEBACK": rung or ADAPTIVE_LADDER, "KVCODEC_ADAPTIVE": "0" if rung else "1",
               # the populating server stores every chunk of every prompt (a deployed one drops past 8 waiting)
               "KVCODEC_WRITEBACK_PENDING": "4096"}
        if base == "kvcodec-vllm-serve-ram":
            env.update(KVCODEC_LOCAL_STORE=f"file://{ram_tier(root.parent)}", KVCODEC_LOCAL_STORE_MB="4096")
        with VllmServe(model, root, env, _port(), prefix_cache=prefix_cache, python=VLLM_PYTHON,
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
        with VllmServe(model, root, env, _port(), connector=False, prefix_cache=prefix_cache,
                       python=LMCACHE_VENV / "bin" / "python",
                       extra_args=["--kv-transfer-config", json.dumps(transfer), *LOGPROBS_ARGS]) as server:
            footprint.watch("vllm", server.process.pid)
            yield server


class EnsembleServer:
    """The Triton ensemble (``kvcodec serve`` on the vLLM engine) behind ``VllmServe``'s calls, over
    gRPC streaming (``KVCodecClient``): ``cached_tokens`` is the response's ``reused_tokens``."""

    def __init__(self, server) -> None:
        from kvcodec_client.client import KVCodecClient

        self.server, self.pid = server, server.pid
        self.client = KVCodecClient(server.grpc_url, "grpc")

    def completion(self, prompt: str, max_tokens: int) -> dict:
        return self.streamed(prompt, max_tokens)

    def streamed(self, prompt: str, max_tokens: int) -> dict:
        r = self.client.generate(prompt, max_tokens)
        return {"ttft_s": r.ttft_s, "text": r.text, "cached_tokens": r.reused_tokens, "elapsed_s": r.total_s,
                "local_tokens": (r.stats.get("engine") or {}).get("local_tokens")}


@contextlib.contextmanager
def ensemble_server(root: Path, store: PeersStore, rung: Optional[str], prefix_cache: bool) -> Iterator[EnsembleServer]:
    """A real tritonserver on the model repository, vLLM engine, the store behind the link; one
    home across the populating and measuring servers (its cost model), as ``kvcodec-vllm-serve``."""
    from kvcodec.settings import Settings
    from kvcodec_tools.cli import DEFAULT_REPOSITORY
    from kvcodec_tools.ports import free_ports
    from kvcodec_tools.tritonserver import Ports, TritonServer

    key_file = root.parent / "chunk.key"
    if not key_file.exists():
        key_file.write_text(_chunk_key(root.parent) + "\n")
        key_file.chmod(0o600)
    ladder = rung or ADAPTIVE_LADDER
    settings = Settings.load({"home": str(root.parent / "home"), "store": store.url, "engine": "vllm",
                              "model_cache": str(REPO / ".cache" / "models"), "threads": "1", "ladder": ladder,
                              "writeback": ladder, "adaptive": "0" if rung else "1", "key_file": str(key_file),
                              "writeback_pending": "4096", "prefix_cache": "1" if prefix_cache else "0"}, env={})
    server = TritonServer(DEFAULT_REPOSITORY, settings, Ports(*free_ports(3)), log_path=root / "tritonserver.log")
    with patched_environ(store.env):  # the store's variables (S3's endpoint and keys) for the server to inherit
        server.start(timeout_s=600)
    try:
        yield EnsembleServer(server)
    finally:
        server.stop()


@contextlib.contextmanager
def patched_environ(values: Dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _chunk_key(root: Path) -> str:
    path = root / "chunk.key.hex"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


@contextlib.contextmanager
def lmcache_server(root: Path, store: PeersStore, fp8: bool) -> Iterator[Tuple[int, int]]:
    """``lmcache server`` with the store as its L2 (``resp`` for Redis, as measured to work on this CPU
    build, ``../shared/FINDINGS.md``; ``s3``); (its port, its pid)."""
    from kvcodec_tools.procs import Process

    port, http_port, prom_port = _port(), _port(), _port()
    adapter = dict(store.adapter)
    if fp8:
        adapter["serde"] = {"type": "fp8"}
    cmd = [str(LMCACHE_VENV / "bin" / "lmcache"), "server", "--port", str(port), "--http-port", str(http_port),
           "--prometheus-port", str(prom_port), "--l1-size-gb", "1", "--l1-init-size-gb", "1",
           "--eviction-policy", "LRU", "--chunk-size", "256", "--supported-transfer-mode", "auto",
           "--l2-adapter", json.dumps(adapter)]
    log = root / f"lmcache-server-{port}.log"
    proc = Process("lmcache-server", cmd, log, append=False, env=dict(os.environ)).start()
    try:
        proc.wait_ready(lambda: _listening(port), 120, logs=[log])
        yield port, proc.pid
    finally:
        proc.stop()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


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
    out: Dict[str, int] = {}
    for line in metrics_text.splitlines():
        if line.startswith("kvcodec_rung_chunks_total{") and 'rung="' in line:
            rung = line.split('rung="', 1)[1].split('"', 1)[0]
            out[rung] = out.get(rung, 0) + int(float(line.rpartition(" ")[2]))
    return out


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
