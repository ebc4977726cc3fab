"""The first GPU checks of the TensorRT-LLM connector (issue 46), prepared and never run: they need
TensorRT-LLM 1.2, which installs nowhere this project runs (NVIDIA's
``tritonserver:<yy.mm>-trtllm-python-py3`` container has it; the lent GPU machine does not). Inside
that container, from the repository root, with the project installed (docs/deploy-trtllm.md, 2.):

    bash tests/gpu/run.sh --trtllm [MODEL_DIR]     # or: python3 -m tests.gpu.trtllm_checks --model DIR

MODEL_DIR: a Hugging Face folder TensorRT-LLM loads (``kvcodec repository --variant trtllm-llmapi``
converts the project's SmolLM2 into one). Every check runs TensorRT-LLM in this process
(``TLLM_WORKER_USE_SINGLE_PROCESS=1``) with the connector named as the engine names it, on a fresh
``file://`` store, greedy; spies on the connector's classes see what TensorRT-LLM hands them:

- ``restore``: a cold run stores its chunks (write-back, ``raw``); a prompt sharing 600 tokens with
  it is offered with the device's prefix hit as ``num_computed_tokens`` (whole blocks of the shared
  part); a fresh LLM is then given the stored chunks, staged as the ensemble stages them: the blocks
  the load wrote equal the stored raw chunks bit for bit and the greedy tokens equal the cold run's;
- ``concurrent``: 16 distinct long prompts, the ``trtllm-llmapi`` arguments (prefetch on): cold,
  stored, prefetched into the stage, then all at once on a fresh LLM: each equals its cold tokens
  and the connector matched every staged token;
- ``failed_load``: a load made to fail in a live run (the pool's write raises once): that request
  gets an error and the next request is still answered, with ``disable_overlap_scheduler`` true
  (must hold) and false (recorded only: 1.2's overlap loop asserts after a failed forward);
- ``memory``: the stage filled to ``stage_bytes`` beside the pool: this process's allocated and
  reserved bytes, the device's free memory and every process's use (``nvidia-smi``).

``--dry-run`` (here, without TensorRT-LLM): builds every check's ``LLM()`` arguments and connector
settings and prints the plan; the unit test of the GPU script runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

CHECKS = ("restore", "concurrent", "failed_load", "memory")
CHUNK, BLOCK, PROMPT, N_CONCURRENT, MAX_TOKENS = 256, 32, 1100, 16, 16


def plan(model: str, home: Path, check: str, overlap: bool = True) -> Dict[str, Any]:
    """``LLM()`` arguments and the connector's settings file of one check (prefetch: llmapi's)."""
    from kvcodec.engines.trtllm_engine import TrtllmEngine, connector_settings, llm_arguments
    from kvcodec.settings import Settings

    settings = Settings.load({"home": str(home), "model": model, "store": f"file://{home / 'store'}",
                              "ladder": "raw", "writeback": "raw", "chunk_tokens": str(CHUNK)}, env={})
    card = TrtllmEngine.model_card(settings)
    args = llm_arguments(model, BLOCK, settings.trtllm_kv_fraction, overlap=overlap)
    return {"args": args, "connector": connector_settings(settings, card, prefetch=check == "concurrent"),
            "card": card}


def prompts(n: int, length: int = PROMPT, seed: int = 0, vocab: int = 40000) -> List[List[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(100, vocab, length)] for _ in range(n)]


class Spy:
    """Wraps the connector's classes (what TensorRT-LLM instantiates in this process) to record calls."""

    def __init__(self) -> None:
        from kvcodec.engines import trtllm_connector as tc

        self.tc, self.saved, self.matched, self.loads, self.fail_next = tc, [], [], [], False
        spy = self

        def matched(inner):
            def wrapper(this, request, num_computed_tokens):
                n = inner(this, request, num_computed_tokens)
                spy.matched.append((int(request.request_id), int(num_computed_tokens), n[0]))
                return n
            return wrapper

        def start_load(inner):
            def wrapper(this, stream=None):
                if spy.fail_next and this.pages is not None:
                    spy.fail_next = False
                    original = this.pages.write
                    this.pages.write = lambda *a: (_ for _ in ()).throw(RuntimeError("injected device error"))
                    try:
                        return inner(this, stream)
                    finally:
                        this.pages.write = original
                jobs = list(getattr(this.get_connector_meta(), "loads", ()))
                inner(this, stream)
                import torch

                torch.cuda.current_stream().synchronize()  # a check, not the connector's path
                spy.loads.extend((j, this.pages.read(j.block_ids, j.start, j.tokens).cpu()) for j in jobs)
            return wrapper

        for cls, name, wrap in ((tc.KVCodecScheduler, "get_num_new_matched_tokens", matched),
                                (tc.KVCodecWorker, "start_load_kv", start_load)):
            self.saved.append((cls, name, getattr(cls, name)))
            setattr(cls, name, wrap(getattr(cls, name)))

    def close(self) -> None:
        for cls, name, fn in self.saved:
            setattr(cls, name, fn)


def _llm(p: Dict[str, Any], home: Path):
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig

    from kvcodec.engines.trtllm_config import CONFIG_ENV

    config = home / f"kvcodec-trtllm-{time.monotonic_ns()}.json"
    config.write_text(json.dumps(p["connector"]))
    os.environ[CONFIG_ENV] = str(config)
    args = dict(p["args"], kv_connector_config=KvCacheConnectorConfig(**p["args"]["kv_connector_config"]))
    return LLM(**args)


def _greedy(llm, batch: List[List[int]]) -> List[List[int]]:
    from tensorrt_llm import SamplingParams

    outs = llm.generate(batch, sampling_params=SamplingParams(max_tokens=MAX_TOKENS, top_k=1))
    return [list(o.outputs[0].token_ids) for o in outs]


def _wait_stored(expected: int, timeout_s: float = 60.0) -> int:
    from kvcodec.engines.trtllm_worker import writeback_stats

    end, stored = time.monotonic() + timeout_s, 0
    while time.monotonic() < end:
        stats = writeback_stats() or {}
        stored = int(stats.get("written", 0)) + int(stats.get("present", 0))
        if stored >= expected:
            break
        time.sleep(0.2)
    return stored


def _stored_kv(p: Dict[str, Any], ids: List[int], chunks: int):
    """The prompt's stored raw chunks, read back by the library (not through the connector)."""
    import numpy as np

    from kvcodec.engines.trtllm_config import from_mapping
    from kvcodec.format.keys import chunk_keys
    from kvcodec.format.ladder import parse_ladder
    from kvcodec.serving.decode import ChunkDecoder
    from kvcodec.serving.restore import restore
    from kvcodec.store import open_store

    card = p["card"]
    scheme = parse_ladder(["raw"], card)[0]
    keys = chunk_keys(ids, card.model_id, scheme.identity, CHUNK)[:chunks]
    store = open_store(p["connector"]["store"])
    decoder = ChunkDecoder(card.model_id, auth=from_mapping(p["connector"]).auth())  # the connector's key
    try:
        return np.concatenate([restore(decoder.decode(store.get(k), key=k)) for k in keys], axis=3)
    finally:
        store.close()


def check_restore(model: str, home: Path) -> Dict[str, Any]:
    import numpy as np
    import torch

    from kvcodec.engines.trtllm_engine import stage_restored
    from kvcodec.engines.trtllm_shared import SHARED

    p, spy = plan(model, home, "restore"), Spy()
    base = prompts(2)
    cold_ids, other = base[0], base[0][:600] + base[1][:500]
    out: Dict[str, Any] = {}
    try:
        llm = _llm(p, home)
        cold = _greedy(llm, [cold_ids])[0]
        out["stored"] = _wait_stored(PROMPT // CHUNK)
        spy.matched.clear()
        _greedy(llm, [other])
        out["device_hit_seen"] = spy.matched[-1][1] if spy.matched else None  # num_computed_tokens given
        llm.shutdown()
        kv = _stored_kv(p, cold_ids, PROMPT // CHUNK)
        llm = _llm(p, home)  # an empty device cache: the connector has to load
        staged = stage_restored(cold_ids, None, torch.from_numpy(kv), CHUNK, 30.0, shared=SHARED)
        spy.loads.clear()
        warm = _greedy(llm, [cold_ids])[0]
        llm.shutdown()
        job, blocks = spy.loads[-1] if spy.loads else (None, None)
        out.update(staged=staged, loaded=job.tokens if job else 0, cold=cold, warm=warm,
                   blocks_equal=bool(blocks is not None and np.array_equal(blocks.numpy(), kv[:, :, :, :job.tokens])))
        out["ok"] = (out["device_hit_seen"] == 600 // BLOCK * BLOCK and out["blocks_equal"] and warm == cold
                     and out["loaded"] == staged > 0)
    finally:
        spy.close()
    return out


def check_concurrent(model: str, home: Path) -> Dict[str, Any]:
    from kvcodec.engines.trtllm_shared import SHARED

    p, spy = plan(model, home, "concurrent"), Spy()
    batch = prompts(N_CONCURRENT, seed=1)
    out: Dict[str, Any] = {}
    try:
        llm = _llm(p, home)
        cold = _greedy(llm, batch)  # computed; their chunks written back; prefetch finds nothing yet
        out["stored"] = _wait_stored(N_CONCURRENT * (PROMPT // CHUNK))
        llm.shutdown()
        llm = _llm(p, home)
        _greedy(llm, batch)  # device prefix cache cold: computed again, each prefix prefetched into the stage
        end = time.monotonic() + 120
        while SHARED.stage.stats()["entries"] < N_CONCURRENT and time.monotonic() < end:
            time.sleep(0.2)
        out["staged_entries"] = SHARED.stage.stats()["entries"]
        llm.shutdown()
        llm = _llm(p, home)  # a fresh pool: only the stage can serve them, all at once
        spy.matched.clear()
        warm = _greedy(llm, batch)
        llm.shutdown()
        out["equal"] = sum(w == c for w, c in zip(warm, cold, strict=True))
        out["matched"] = sum(n for _, _, n in spy.matched)
        out["ok"] = out["equal"] == N_CONCURRENT and out["matched"] == N_CONCURRENT * (PROMPT // CHUNK) * CHUNK
    finally:
        spy.close()
    return out


def check_failed_load(model: str, home: Path) -> Dict[str, Any]:
    import torch
    from tensorrt_llm import SamplingParams

    from kvcodec.engines.trtllm_engine import stage_restored
    from kvcodec.engines.trtllm_shared import SHARED

    out: Dict[str, Any] = {}
    for overlap in (False, True):
        p, spy = plan(model, home, "failed_load", overlap=overlap), Spy()
        ids, after = prompts(2, seed=2)
        row: Dict[str, Any] = {}
        try:
            llm = _llm(p, home)
            kv = torch.randn(p["card"].layers, 2, p["card"].kv_heads, 2 * CHUNK, p["card"].head_dim)
            row["staged"] = stage_restored(ids, None, kv, CHUNK, 30.0, shared=SHARED)
            spy.fail_next = True
            params = SamplingParams(max_tokens=MAX_TOKENS, top_k=1)
            try:
                llm.generate_async(ids, sampling_params=params).result(timeout=60)
                row["failed_request"] = "answered (not failed)"
            except Exception as exc:  # the request's error: what _handle_errors answered
                row["failed_request"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            try:
                llm.generate_async(after, sampling_params=params).result(timeout=60)
                row["executor_alive"] = True
            except Exception as exc:
                row["executor_alive"], row["after_error"] = False, f"{type(exc).__name__}: {str(exc)[:200]}"
            _shutdown(llm, row)
        finally:
            spy.close()
        out["overlap" if overlap else "no_overlap"] = row
    out["ok"] = bool(out["no_overlap"].get("executor_alive")) and "error" in out["no_overlap"]["failed_request"]
    return out


def _shutdown(llm, row: Dict[str, Any]) -> None:
    try:
        llm.shutdown()
    except Exception as exc:  # a dead executor may not shut down cleanly: recorded, not raised
        row["shutdown_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"


def check_memory(model: str, home: Path) -> Dict[str, Any]:
    import torch

    from kvcodec.engines.trtllm_engine import stage_restored
    from kvcodec.engines.trtllm_shared import SHARED

    p = plan(model, home, "memory")
    free0, total = torch.cuda.mem_get_info()
    llm = _llm(p, home)
    pages = SHARED.pages
    out: Dict[str, Any] = {"kv_fraction": p["args"]["kv_cache_config"]["free_gpu_memory_fraction"],
                           "free_before_bytes": free0, "total_bytes": total,
                           "pool_bytes": sum(k.numel() * k.element_size() * 2 for k, _ in pages.views[:1])
                           * pages.layers if pages is not None else None}
    card, i = p["card"], 0
    while SHARED.stage.bytes + 4 * CHUNK * card.layers * 2 * card.kv_heads * card.head_dim * 2 <= \
            SHARED.stage.max_bytes:
        ids = prompts(1, length=4 * CHUNK + 1, seed=100 + i)[0]
        kv = torch.randn(card.layers, 2, card.kv_heads, 4 * CHUNK, card.head_dim, dtype=torch.float16)
        if not stage_restored(ids, None, kv, CHUNK, 30.0, shared=SHARED):
            break
        i += 1
    free1, _ = torch.cuda.mem_get_info()
    out.update(stage_bytes=SHARED.stage.bytes, stage_max=SHARED.stage.max_bytes, free_after_bytes=free1,
               allocated_bytes=torch.cuda.memory_allocated(), reserved_bytes=torch.cuda.memory_reserved(),
               processes=_nvidia_smi())
    llm.shutdown()
    out["ok"] = out["stage_bytes"] <= out["stage_max"] and free1 > 0
    return out


def _nvidia_smi() -> Optional[str]:
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _dry_model(folder: Path) -> str:
    """A small Llama folder for the dry run (the tests' own, tokenizer from the project's model)."""
    from kvcodec.engines.gguf import ensure_model
    from tests.other_model import write_model

    repo = Path(__file__).resolve().parents[2]
    return str(write_model(folder, ensure_model(repo / ".cache" / "models").path))


RUNNERS: Dict[str, Callable[[str, Path], Dict[str, Any]]] = {
    "restore": check_restore, "concurrent": check_concurrent, "failed_load": check_failed_load,
    "memory": check_memory}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a Hugging Face folder TensorRT-LLM loads")
    parser.add_argument("--json", default="", help="write the report here")
    parser.add_argument("--only", default=",".join(CHECKS), help="checks to run, comma-separated")
    parser.add_argument("--dry-run", action="store_true", help="build each check's arguments; run nothing")
    args = parser.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        print(f"unknown check(s) {unknown} (known: {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    os.environ["TLLM_WORKER_USE_SINGLE_PROCESS"] = "1"  # before the first LLM(): executor in this process
    report: Dict[str, Any] = {"checks": {}, "dry_run": args.dry_run}
    with tempfile.TemporaryDirectory(prefix="kvcodec-trtllm-") as tmp:
        if args.dry_run:
            model = args.model or _dry_model(Path(tmp) / "model")
            for check in only:
                p = plan(model, Path(tmp) / check, check)
                report["checks"][check] = {"ok": None, "args": sorted(p["args"]),
                                           "prefetch": p["connector"]["prefetch"],
                                           "kv_fraction": p["args"]["kv_cache_config"]["free_gpu_memory_fraction"]}
            report["ok"] = True
        else:
            try:
                import tensorrt_llm  # noqa: F401
            except ImportError as exc:
                print(f"these checks need TensorRT-LLM 1.2 (NVIDIA's tritonserver -trtllm-python container): {exc}",
                      file=sys.stderr)
                return 2
            if not args.model:
                print("--model DIR is required (kvcodec repository --variant trtllm-llmapi converts one)",
                      file=sys.stderr)
                return 2
            for check in only:
                t0 = time.monotonic()
                try:
                    report["checks"][check] = RUNNERS[check](args.model, Path(tmp) / check)
                except Exception as exc:  # one check's failure is its row, the others still run
                    report["checks"][check] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                report["checks"][check]["wall_s"] = round(time.monotonic() - t0, 1)
                print(json.dumps({check: report["checks"][check]}, default=str), flush=True)
            report["ok"] = all(r.get("ok") for r in report["checks"].values())
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
