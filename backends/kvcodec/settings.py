"""Typed settings, parsed once (in a model's ``initialize`` or a CLI command).

Each setting comes, first match wins, from an explicit mapping (a Triton model's config
``parameters`` or CLI flags), then the environment (``KVCODEC_<NAME>``, which ``kvcodec serve``
sets for the server it starts), then the default. Unknown keys and bad values are errors that
name the field and the value.

| field         | env                    | default                                 |
|---------------|------------------------|-----------------------------------------|
| home          | KVCODEC_HOME           | ``./.cache``                            |
| store         | KVCODEC_STORE          | ``file://<home>/store``                 |
| local_store   | KVCODEC_LOCAL_STORE    | empty: off; else a store on this machine (``file:///dev/shm/kvcodec``: RAM) read before ``store`` and filled by every chunk read from it or written to it (9) |
| local_store_mb | KVCODEC_LOCAL_STORE_MB | 1024: what the local store may hold; past it the least recently used chains go, from their tail |
| model_cache   | KVCODEC_MODEL_CACHE    | ``<home>/models``                       |
| model         | KVCODEC_MODEL          | none: SmolLM2-135M-Instruct, embedded (4) |
| engine        | KVCODEC_ENGINE         | ``transformers`` (``kvcodec.engines.ENGINES``)  |
| ladder        | KVCODEC_LADDER         | ``kvtc-w,video,int8-zstd,raw`` (1)              |
| chunk_tokens  | KVCODEC_CHUNK_TOKENS   | 256                                     |
| threads       | KVCODEC_THREADS        | 0 (torch's default)                     |
| decoder       | KVCODEC_DECODER        | ``pyav`` (``nvdec``, ``auto``)          |
| entropy       | KVCODEC_ENTROPY        | ``auto``: the zstd rungs' decoder: nvCOMP on a GPU instance where it opens, else the CPU (``cpu``, ``nvcomp``) (6) |
| adaptive      | KVCODEC_ADAPTIVE       | 1: choose a rung per chunk, recompute when faster (0: first stored rung) |
| link_mbps     | KVCODEC_LINK_MBPS      | 1000: the link rate assumed before one is measured |
| deadline_s    | KVCODEC_DEADLINE_S     | 0: fastest rungs; > 0: best quality that meets this fetch deadline |
| key_file      | KVCODEC_KEY_FILE       | ``<home>/chunk.key``: the chunk signing key (2) |
| trtllm_overlap_scheduler | KVCODEC_TRTLLM_OVERLAP_SCHEDULER | 0: the ``trtllm`` engine runs TensorRT-LLM with ``disable_overlap_scheduler`` (a failed KV load fails that step's requests and the executor goes on); 1: TensorRT-LLM's overlap scheduler (faster; in 1.2 a failed load then ends its executor: docs/deploy-trtllm.md) |
| trtllm_kv_fraction | KVCODEC_TRTLLM_KV_FRACTION | 0.6: the ``trtllm`` engine's KV pool, as a share of the GPU memory free after its weights (TensorRT-LLM's ``free_gpu_memory_fraction``; its own default, 0.9, leaves too little for the stage and the other steps: docs/deploy-trtllm.md, "GPU memory") |
| encrypt_chunks | KVCODEC_ENCRYPT_CHUNKS | 0: chunks are signed, stored in the clear; 1: every chunk this process writes is encrypted (AES-256-GCM, a key per tenant derived from the chunk key) (10) |
| key_file_previous | KVCODEC_KEY_FILE_PREVIOUS | empty; else a file of previous keys (hex, mode 0600) that verify but never sign: chunks they signed are used and re-signed with the current key (8) |
| fetch_timeout_s | KVCODEC_FETCH_TIMEOUT_S | 20: the outer bound on a request's store calls; the fetcher gives up sooner, when recomputing is predicted faster (``kvcodec.serving.fetch``) |
| writeback     | KVCODEC_WRITEBACK      | ``first``: after a miss, store the new full chunks at the ladder's first rung (3) |
| writeback_pending | KVCODEC_WRITEBACK_PENDING | 8: write-back jobs (chunks) that may wait; past it new ones are dropped, counted (``kvcodec.connector.WriteBackSink``) |
| ingest_workers | KVCODEC_INGEST_WORKERS | 0: ``min(2, cores)`` chunk encoders side by side at ingest (``kvcodec.ingest``) |
| decoder_process | KVCODEC_DECODER_PROCESS | 1: kv_decode runs PyAV in a process of its own (a crash is a miss; ``kvcodec.bitstream.isolated``) |
| decode_timeout_s | KVCODEC_DECODE_TIMEOUT_S | 30: that process's deadline per chunk (killed after it: a miss) |
| store_ca_file | KVCODEC_STORE_CA_FILE  | empty: the system CAs; else a PEM CA bundle that ``https://`` and ``rediss://`` stores verify against |
| stream_loads  | KVCODEC_STREAM_LOADS   | 1: an engine that can (vLLM, TensorRT-LLM) takes a request at its first chunk (0: after the last) |
| async_loads   | KVCODEC_ASYNC_LOADS    | 1: a streamed request's blocks are allocated at once and each chunk written as it arrives (vLLM: an asynchronous load); 0: the engine asks again until the chunks are in, then loads them in one go (5) |
| step_tokens   | KVCODEC_STEP_TOKENS    | 0: the engine's default token budget per step (vLLM ``max_num_batched_tokens``: 512) (5) |
| prefix_cache  | KVCODEC_PREFIX_CACHE   | 1: vLLM keeps its own prefix cache, the first tier: the connector loads only the tokens vLLM does not hold (the response's ``reused_tokens`` counts both; ``stats.engine.local_tokens`` the local ones); 0: off, every reuse crosses the store (the benchmarks of the store path set it) |
| exclude_input_in_output | KVCODEC_EXCLUDE_INPUT_IN_OUTPUT | 0: a ``text_input`` request that does not send ``exclude_input_in_output`` gets its prompt back before the answer, as TensorRT-LLM's model parameter of that name; 1: the answer alone (set it behind Triton's OpenAI frontend, which never sends the input) (7) |
| vllm_engine_args | KVCODEC_VLLM_ENGINE_ARGS | empty; else a JSON object of vLLM's own ``EngineArgs`` names merged over the ``vllm`` engine's defaults (e.g. ``{"gpu_memory_utilization": 0.85, "max_num_seqs": 64, "max_model_len": 32768, "quantization": "fp8"}``); unknown names are refused, naming them (11) |
| prefill_slice | KVCODEC_PREFILL_SLICE  | 0: the engine's default; at most this many tokens of one long prefill per step (vLLM ``long_prefill_token_threshold``: 128; as large as step_tokens: off) (5) |

(1) rungs that pass the quality gate, in preference order; ``KVCODEC_CODECS``, the setting's old
name, is still read from the environment.
(3) ``off``, ``first`` or a ladder spec (e.g. ``raw,transform-zstd``); done off the request's path by
engines that save (``vllm``, ``trtllm``: ``kvcodec.connector.WriteBackSink``).
(2) made on first use, mode 0600; ``KVCODEC_CHUNK_KEY`` (the key, hex) takes its place
(``kvcodec.format.auth``).
(5) scheduling levers of a batching engine: smaller steps and sliced prefills let a reuse request's
few tokens to compute start at the next step instead of waiting behind other requests' prefills
(``perf/results/README.md``, "Reuse under load").
(6) ``kvcodec.bitstream.decoders.ENTROPY_DECODERS``; a CPU instance of kv_decode always decodes on
the CPU (``nvcomp`` there fails its start). Each rung's decode time is measured per chunk, so the
adaptive fetcher weighs a GPU-decoded entropy rung against NVDEC's video by what each costs here.
(7) read by kv_fetch (``kvcodec.triton.interface``); a request's own ``exclude_input_in_output`` wins.
(8) ``KVCODEC_CHUNK_KEY_PREVIOUS`` (hex, comma-separated) takes its place; the steps of a rotation
are in docs/operations.md, "Rotating the chunk key" (``kvcodec.format.auth``, ``kvcodec.serving.resign``).
(9) ``kvcodec.store.tiered``: the local tier outlives the engine (a restarted server, a second
engine on the machine read it), unlike the engine's own prefix cache; the adaptive fetcher prices it
as a link of its own, and ``kvcodec_tier_chunks_total{tier}`` counts the chunks each tier served.
(10) ``kvcodec.format.auth``: readers decrypt whatever is encrypted, whatever this setting says; a
tenant's key is HKDF of the chunk key with the request's cache salt, so one leaked tenant key opens
that tenant's chunks alone; what it costs and when to leave it off: docs/operations.md, "Tenants".
(11) ``kvcodec.engines.vllm_engine.engine_args``: the defaults are the model's context (``max_position_embeddings``),
float16 and vLLM's CUDA graphs on a GPU, float32 and ``enforce_eager`` on the CPU build; the model card's
``max_context`` and KV dtype follow what is passed. Refused: names a setting owns (``model``,
``enable_prefix_caching``: prefix_cache, ``max_num_batched_tokens``: step_tokens,
``long_prefill_token_threshold``: prefill_slice, ``kv_transfer_config``), a dtype other than float16/float32,
a ``kv_cache_dtype`` other than auto, parallel sizes above 1.
(4) a Hugging Face folder (``config.json``, ``*.safetensors``, tokenizer files) of a Llama-family
model (``kvcodec.engines.model_files.ARCHITECTURES``); its identity, KV geometry and tokenizer come
from the folder, its codec profile is fitted with ``kvcodec profile fit --model DIR``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping, Optional, Tuple

from .errors import ConfigError
from .format.ladder import DEFAULT_LADDER, parse_ladder

DECODER_CHOICES = ("pyav", "nvdec", "auto")
ENTROPY_CHOICES = ("auto", "cpu", "nvcomp")
# Model config parameters that Triton's python backend reads itself: not settings.
TRITON_OWN_PARAMETERS = frozenset({"FORCE_CPU_ONLY_INPUT_TENSORS", "EXECUTION_ENV_PATH"})


@dataclass(frozen=True)
class Settings:
    home: Path
    store: str
    model_cache: Path
    ladder: Tuple[str, ...]  # rung specs, in preference order (a ladder; see docs/codecs.md's glossary)
    chunk_tokens: int
    threads: int
    decoder: str
    adaptive: bool = True
    link_mbps: float = 1000.0
    deadline_s: float = 0.0
    engine: str = "transformers"
    key_file: Path = Path(".cache/chunk.key")
    fetch_timeout_s: float = 20.0
    writeback: Tuple[str, ...] = ()  # rung specs to store after a miss (empty: off)
    ingest_workers: int = 0  # chunk encoders side by side at ingest (0: ingest's default)
    decoder_process: bool = True  # kv_decode's PyAV decoder in a process of its own
    decode_timeout_s: float = 30.0  # that process's deadline per chunk
    model: Optional[Path] = None  # a Hugging Face model folder (None: the embedded SmolLM2-135M-Instruct)
    store_ca_file: str = ""  # a PEM CA bundle for TLS stores ("": the system CAs)
    stream_loads: bool = True  # a streaming engine takes a request at its first chunk
    async_loads: bool = True  # streamed chunks written into allocated blocks as they arrive (0: loaded once in)
    step_tokens: int = 0  # the engine's token budget per step (0: the engine's default)
    prefill_slice: int = 0  # at most this many tokens of one long prefill per step (0: the engine's default)
    entropy: str = "auto"  # the zstd rungs' decoder in kv_decode (ENTROPY_CHOICES)
    writeback_pending: int = 8  # write-back chunks that may wait before new ones are dropped
    exclude_input_in_output: bool = False  # a text request's answer without its prompt when it does not say
    prefix_cache: bool = True  # vLLM's own prefix cache in front of the store
    key_file_previous: Optional[Path] = None  # previous chunk keys: verify, never sign (format.auth)
    local_store: str = ""  # a store on this machine read before ``store`` ("": none; store.tiered)
    local_store_mb: int = 1024  # what the local store may hold
    encrypt_chunks: bool = False  # chunks written are encrypted per tenant (format.auth)
    trtllm_kv_fraction: float = 0.6  # the trtllm engine's free_gpu_memory_fraction
    trtllm_overlap_scheduler: bool = False  # TensorRT-LLM's overlap scheduler (off: a failed load is survived)
    vllm_engine_args: str = ""  # a JSON object of vLLM EngineArgs (kvcodec.engines.vllm_engine.engine_args)

    @classmethod
    def load(cls, explicit: Optional[Mapping[str, str]] = None, env: Optional[Mapping[str, str]] = None) -> "Settings":
        explicit = {k: v for k, v in (explicit or {}).items() if v not in (None, "")}
        env = os.environ if env is None else env
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(explicit) - names)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")

        def raw(name: str) -> Optional[str]:
            if name in explicit:
                return str(explicit[name])
            value = env.get(f"KVCODEC_{name.upper()}") or None
            if value is None and name == "ladder":
                value = env.get("KVCODEC_CODECS") or None  # the setting's name before it was called a ladder
            return value

        home = Path(raw("home") or ".cache").expanduser().resolve()
        store = raw("store") or f"file://{home / 'store'}"
        model_cache = Path(raw("model_cache") or home / "models").expanduser().resolve()
        ladder = tuple(c.strip() for c in (raw("ladder") or ",".join(DEFAULT_LADDER)).split(",") if c.strip())
        if not ladder:
            raise ConfigError(f"ladder names no codec (got {raw('ladder')!r})")
        try:
            parse_ladder(ladder)
        except ConfigError as exc:
            raise ConfigError(f"ladder: {exc}") from None
        chunk_tokens = _int("chunk_tokens", raw("chunk_tokens") or "256", minimum=8)
        if chunk_tokens % 8:
            raise ConfigError(f"chunk_tokens must be a multiple of 8, got {chunk_tokens}")
        threads = _int("threads", raw("threads") or "0", minimum=0)
        decoder = raw("decoder") or "pyav"
        if decoder not in DECODER_CHOICES:
            raise ConfigError(f"decoder must be one of {', '.join(DECODER_CHOICES)}, got {decoder!r}")
        entropy = raw("entropy") or "auto"
        if entropy not in ENTROPY_CHOICES:
            raise ConfigError(f"entropy must be one of {', '.join(ENTROPY_CHOICES)}, got {entropy!r}")
        adaptive = _bool("adaptive", raw("adaptive") or "1")
        link_mbps = _float("link_mbps", raw("link_mbps") or "1000", minimum=0.001)
        deadline_s = _float("deadline_s", raw("deadline_s") or "0", minimum=0.0)
        key_file = Path(raw("key_file") or home / "chunk.key").expanduser().resolve()
        fetch_timeout_s = _float("fetch_timeout_s", raw("fetch_timeout_s") or "20", minimum=0.001)
        writeback = _writeback(raw("writeback") or "first", ladder)
        ingest_workers = _int("ingest_workers", raw("ingest_workers") or "0", minimum=0)
        decoder_process = _bool("decoder_process", raw("decoder_process") or "1")
        decode_timeout_s = _float("decode_timeout_s", raw("decode_timeout_s") or "30", minimum=0.001)
        model = _model(raw("model"))
        store_ca_file = raw("store_ca_file") or ""
        if store_ca_file:
            store_ca_file = str(Path(store_ca_file).expanduser().resolve())
            if not Path(store_ca_file).is_file():
                raise ConfigError(f"store_ca_file must be a PEM CA bundle file, got {raw('store_ca_file')!r}")
        stream_loads = _bool("stream_loads", raw("stream_loads") or "1")
        async_loads = _bool("async_loads", raw("async_loads") or "1")
        step_tokens = _int("step_tokens", raw("step_tokens") or "0", minimum=0)
        prefill_slice = _int("prefill_slice", raw("prefill_slice") or "0", minimum=0)
        writeback_pending = _int("writeback_pending", raw("writeback_pending") or "8", minimum=1)
        exclude_input_in_output = _bool("exclude_input_in_output", raw("exclude_input_in_output") or "0")
        prefix_cache = _bool("prefix_cache", raw("prefix_cache") or "1")
        key_file_previous = Path(raw("key_file_previous")).expanduser().resolve() if raw("key_file_previous") else None
        if key_file_previous is not None and not key_file_previous.is_file():
            raise ConfigError(f"key_file_previous must be a file of previous chunk keys, got {raw('key_file_previous')!r}")
        local_store = raw("local_store") or ""
        if local_store and "://" not in local_store:
            raise ConfigError(f"local_store must be a store URL (file:///dev/shm/kvcodec), got {local_store!r}")
        local_store_mb = _int("local_store_mb", raw("local_store_mb") or "1024", minimum=1)
        encrypt_chunks = _bool("encrypt_chunks", raw("encrypt_chunks") or "0")
        trtllm_kv_fraction = _float("trtllm_kv_fraction", raw("trtllm_kv_fraction") or "0.6", minimum=0.01)
        trtllm_overlap_scheduler = _bool("trtllm_overlap_scheduler", raw("trtllm_overlap_scheduler") or "0")
        if trtllm_kv_fraction >= 1.0:
            raise ConfigError(f"trtllm_kv_fraction must be below 1, got {trtllm_kv_fraction}")
        vllm_engine_args = _json_object("vllm_engine_args", raw("vllm_engine_args") or "")
        engine = raw("engine") or "transformers"
        from .registry import ENGINES  # names only: no engine is imported here

        if engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES.names())}, got {engine!r}")
        return cls(home, store, model_cache, ladder, chunk_tokens, threads, decoder,
                   adaptive, link_mbps, deadline_s, engine, key_file, fetch_timeout_s, writeback,
                   ingest_workers, decoder_process, decode_timeout_s, model=model, store_ca_file=store_ca_file,
                   stream_loads=stream_loads, async_loads=async_loads, step_tokens=step_tokens,
                   prefill_slice=prefill_slice, entropy=entropy, writeback_pending=writeback_pending,
                   exclude_input_in_output=exclude_input_in_output, prefix_cache=prefix_cache,
                   key_file_previous=key_file_previous, local_store=local_store, local_store_mb=local_store_mb,
                   encrypt_chunks=encrypt_chunks, trtllm_kv_fraction=trtllm_kv_fraction,
                   trtllm_overlap_scheduler=trtllm_overlap_scheduler,
                   vllm_engine_args=vllm_engine_args)

    def environ(self) -> dict:
        """These settings as ``KVCODEC_*`` variables, for a server process to inherit."""
        return {
            "KVCODEC_HOME": str(self.home),
            "KVCODEC_STORE": self.store,
            "KVCODEC_MODEL_CACHE": str(self.model_cache),
            "KVCODEC_LADDER": ",".join(self.ladder),
            "KVCODEC_CHUNK_TOKENS": str(self.chunk_tokens),
            "KVCODEC_THREADS": str(self.threads),
            "KVCODEC_DECODER": self.decoder,
            "KVCODEC_ADAPTIVE": "1" if self.adaptive else "0",
            "KVCODEC_LINK_MBPS": repr(self.link_mbps),
            "KVCODEC_DEADLINE_S": repr(self.deadline_s),
            "KVCODEC_ENGINE": self.engine,
            "KVCODEC_KEY_FILE": str(self.key_file),
            "KVCODEC_KEY_FILE_PREVIOUS": str(self.key_file_previous or ""),
            "KVCODEC_FETCH_TIMEOUT_S": repr(self.fetch_timeout_s),
            "KVCODEC_WRITEBACK": ",".join(self.writeback) or "off",
            "KVCODEC_INGEST_WORKERS": str(self.ingest_workers),
            "KVCODEC_DECODER_PROCESS": "1" if self.decoder_process else "0",
            "KVCODEC_DECODE_TIMEOUT_S": repr(self.decode_timeout_s),
            "KVCODEC_MODEL": str(self.model or ""),
            "KVCODEC_STORE_CA_FILE": self.store_ca_file,
            "KVCODEC_STREAM_LOADS": "1" if self.stream_loads else "0",
            "KVCODEC_ASYNC_LOADS": "1" if self.async_loads else "0",
            "KVCODEC_STEP_TOKENS": str(self.step_tokens),
            "KVCODEC_PREFILL_SLICE": str(self.prefill_slice),
            "KVCODEC_ENTROPY": self.entropy,
            "KVCODEC_WRITEBACK_PENDING": str(self.writeback_pending),
            "KVCODEC_EXCLUDE_INPUT_IN_OUTPUT": "1" if self.exclude_input_in_output else "0",
            "KVCODEC_PREFIX_CACHE": "1" if self.prefix_cache else "0",
            "KVCODEC_LOCAL_STORE": self.local_store,
            "KVCODEC_LOCAL_STORE_MB": str(self.local_store_mb),
            "KVCODEC_ENCRYPT_CHUNKS": "1" if self.encrypt_chunks else "0",
            "KVCODEC_TRTLLM_KV_FRACTION": repr(self.trtllm_kv_fraction),
            "KVCODEC_TRTLLM_OVERLAP_SCHEDULER": "1" if self.trtllm_overlap_scheduler else "0",
            "KVCODEC_VLLM_ENGINE_ARGS": self.vllm_engine_args,
        }


def _model(value: Optional[str]) -> Optional[Path]:
    """The model folder, resolved; it must hold a ``config.json`` (the rest is checked when it is used)."""
    if value is None:
        return None
    path = Path(value).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model must be a Hugging Face model folder with a config.json, got {value!r}")
    return path


def _writeback(value: str, ladder: Tuple[str, ...]) -> Tuple[str, ...]:
    value = value.strip()
    if value == "off":
        return ()
    if value == "first":
        return ladder[:1]
    rungs = tuple(c.strip() for c in value.split(",") if c.strip())
    try:
        parse_ladder(rungs)
    except ConfigError as exc:
        raise ConfigError(f"writeback: {exc} (or 'off', 'first')") from None
    return rungs


def _json_object(name: str, value: str) -> str:
    """A JSON object with string keys, as compact JSON text ("" for none)."""
    if not value.strip():
        return ""
    import json

    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} must be a JSON object, got {value!r}: {exc}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{name} must be a JSON object, got {value!r}")
    return json.dumps(parsed, sort_keys=True, separators=(",", ":"))


def _bool(name: str, value: str) -> bool:
    value = value.strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes")


def _int(name: str, value: str, minimum: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if n < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {n}")
    return n


def _float(name: str, value: str, minimum: float) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if not x >= minimum or x != x or x == float("inf"):
        raise ConfigError(f"{name} must be a finite number >= {minimum}, got {value!r}")
    return x
