"""``kvcodec bench tenants``: what keeping tenants apart costs and whether it holds, in one run.

One context is ingested twice at one rung, for two tenants (two cache salts): in the clear for one,
encrypted (``encrypt_chunks``: AES-256-GCM per tenant) for the other, into one store. At each link
rate (a throttled link: ``kvcodec_tools.shaping``; nginx behind it) one tritonserver serves both,
and the same prompt is asked, interleaved run by run (which goes first swapped each run) so that the
machine's noise and any effect of order fall on both alike:

- ``prefill``: no reuse (what a stranger's request must cost);
- ``plain``: the clear tenant's reuse;
- ``encrypted``: the encrypted tenant's reuse;
- ``stranger``: a third salt sending the encrypted tenant's document: must reuse 0 tokens and give
  prefill's tokens (``cross_tenant_reused_tokens``).

Beside it, in this process: the AES-GCM decrypt throughput on the stored chunks' own payloads
(``decrypt_mb_s``, MB of chunk a second on one core; ``decrypt_ms_per_chunk``: that for a mean
chunk) and the whole parse of one chunk encrypted against the same chunk in the clear
(``parse_ms_encrypted``, ``parse_ms_clear``: the clear one checks each section's digest, which
AES-GCM's authentication makes needless for the encrypted one).

The JSON (``perf/results/tenants.json``): ``cross_tenant_reused_tokens``, ``encrypted`` (every
chunk of the encrypted tenant's was stored encrypted), ``ttft_ratio_1g``, ``ttft_ratio_10g``
(encrypted / plain TTFT p50 at 1 and 10 Gbit/s; target <= 1.03), ``decrypt_mb_s``, and the rows.
Exits non-zero when a stranger reused anything or an answer differs from prefill's.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

from .cli import DEFAULT_REPOSITORY, REPO_ROOT, _list, _settings, common
from .stats import percentile

SALTS = {"plain": "bench-tenant-plain", "encrypted": "bench-tenant-encrypted", "stranger": "bench-tenant-stranger"}
QUESTION = "\n\n# Question: which function above is the longest?\n# Answer:"


def decrypt_speed(chunks: List[bytes], auth, reps: int = 20) -> dict:
    """AES-GCM throughput over the stored chunks' sections, and a chunk's parse encrypted against clear."""
    from kvcodec.format import container

    parsed = [container.parse(c, auth) for c in chunks]
    clear = [p.to_bytes(auth, encrypt=False) for p in parsed]
    sealed = [(p.header.get("tenant", ""), p) for p in parsed]
    nbytes = sum(len(c) for c in chunks)
    t0 = time.perf_counter()
    for _ in range(reps):
        for c in chunks:
            container.parse(c, auth)
    t_enc = (time.perf_counter() - t0) / (reps * len(chunks))
    t0 = time.perf_counter()
    for _ in range(reps):
        for c in clear:
            container.parse(c, auth)
    t_clear = (time.perf_counter() - t0) / (reps * len(chunks))
    payload = bytes(sealed[0][1].sections["payload"])
    blob = auth.seal(sealed[0][0], b"aad", payload)
    t0 = time.perf_counter()
    for _ in range(reps * 5):
        auth.unseal(sealed[0][0], b"aad", blob)
    t_aes = (time.perf_counter() - t0) / (reps * 5)
    # the AES-GCM time of a mean chunk; the parses differ by more than that: a clear chunk's sections
    # are checked by their digest (blake2b), an encrypted chunk's by AES-GCM alone
    return {"decrypt_mb_s": round(len(payload) / t_aes / 1e6, 1),
            "decrypt_ms_per_chunk": round(nbytes / len(chunks) / (len(payload) / t_aes) * 1e3, 3),
            "parse_ms_encrypted": round(t_enc * 1e3, 3), "parse_ms_clear": round(t_clear * 1e3, 3),
            "chunk_bytes_mean": int(nbytes / len(chunks)), "chunks": len(chunks)}


def run(settings, repository: Path, bandwidths: List[float], context: int, rung: str, runs: int,
        json_path: Path, link_mode: str, delay_ms: float) -> int:
    from tqdm import tqdm

    from kvcodec.engines import open_engine
    from kvcodec.format import container
    from kvcodec.format.auth import auth_for
    from kvcodec.ingest import ingest_rungs
    from kvcodec.store import open_store
    from kvcodec_client.client import KVCodecClient
    from kvcodec_tools.tritonserver import Ports, TritonServer

    from .bench import context_ids
    from .ports import free_ports
    from .remote_store import loopback_store, new_store_token, store_behind_link

    work = settings.home / "bench-tenants"
    token = new_store_token()
    engine = open_engine(replace(settings, threads=2))
    ids = context_ids(engine.tokenizer, context)
    prompt = ids + engine.tokenize(QUESTION)
    with loopback_store(work / "nginx", token) as url:
        for tenant in ("plain", "encrypted"):
            with tqdm(total=context // settings.chunk_tokens, unit="chunk", desc=f"ingest {tenant}") as bar:
                ingest_rungs(replace(settings, encrypt_chunks=tenant == "encrypted"), engine, ids, rung,
                             store_url=url, threads=2, progress=bar.update, salt=SALTS[tenant])
        auth = auth_for(settings)
        with open_store(url) as store:
            stored = [store.get(e.key) for e in store.scan()]
        kinds = [container.parse(c, auth) for c in stored]
        encrypted = [c for c, k in zip(stored, kinds, strict=True) if k.encrypted]
        tenants = {k.header.get("tenant", "") for k in kinds if k.encrypted}
        speed = decrypt_speed(encrypted, auth)
    if hasattr(engine, "close"):
        engine.close()
    del engine

    rows: List[dict] = []
    wrong: List[str] = []
    cross = 0
    bar = tqdm(total=len(bandwidths) * (2 + 2 * (runs + 1) + 1), unit="request", desc="tenants")
    for bw in bandwidths:
        with store_behind_link(work / "nginx", token, bw, delay_ms, link_mode) as (url, link):
            server_settings = replace(settings, store=url, ladder=(rung,), adaptive=False, threads=2,
                                      prefix_cache=False, writeback=())
            with TritonServer(repository, server_settings, Ports(*free_ports(3))) as server:
                client = KVCodecClient(server.grpc_url, "grpc")
                client.generate(prompt[:32], 1, reuse=False)  # one-time costs
                prefill = [client.generate(prompt, 4, reuse=False) for _ in range(2)]
                bar.update(2)
                by: Dict[str, list] = {"plain": [], "encrypted": []}
                for tenant in by:  # warm-up: the link estimate, the decoders
                    client.generate(prompt, 4, cache_salt=SALTS[tenant])
                    bar.update(1)
                for i in range(runs):  # interleaved, the order swapped each run: noise and order fall on both alike
                    for tenant in (("plain", "encrypted") if i % 2 == 0 else ("encrypted", "plain")):
                        by[tenant].append(client.generate(prompt, 4, cache_salt=SALTS[tenant]))
                        bar.update(1)
                stranger = client.generate(prompt, 4, cache_salt=SALTS["stranger"])
                bar.update(1)
            cross += stranger.reused_tokens
            for method, results in (("prefill", prefill), ("plain", by["plain"]), ("encrypted", by["encrypted"]),
                                    ("stranger", [stranger])):
                ttfts = [r.ttft_s for r in results]
                equal = all(r.tokens == prefill[0].tokens for r in results)
                if not equal:
                    wrong.append(f"{method} at {bw:g} Mbit/s")
                rows.append({"method": method, "bandwidth_mbps": bw, "link": link.kind, "context_tokens": context,
                             "rung": rung if method != "prefill" else "", "ttft_p50_s": round(percentile(ttfts, 50), 4),
                             "ttft_mean_s": round(statistics.mean(ttfts), 4), "ttft_s": [round(t, 4) for t in ttfts],
                             "reused_tokens": results[-1].reused_tokens, "prompt_tokens": len(prompt),
                             "bytes_fetched": int(results[-1].stats.get("bytes_fetched", 0)),
                             "decode_s": results[-1].stats.get("decode_s"), "tokens_equal_prefill": equal})
    bar.close()

    def ratio(bw: float):
        p50 = {r["method"]: r["ttft_p50_s"] for r in rows if r["bandwidth_mbps"] == bw}
        return round(p50["encrypted"] / p50["plain"], 4) if "plain" in p50 and p50["plain"] else None

    result = {"cross_tenant_reused_tokens": cross,
              "encrypted": len(encrypted) == context // settings.chunk_tokens and tenants == {_tenant(SALTS["encrypted"])},
              "ttft_ratio_1g": ratio(1000.0), "ttft_ratio_10g": ratio(10000.0), **speed,
              "target_ttft_ratio": 1.03, "rows": rows, "runs": runs, "engine": settings.engine,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['bandwidth_mbps']:>8g} Mbit/s  {r['method']:<10} ttft p50 {r['ttft_p50_s']:.3f} s  "
              f"reused {r['reused_tokens']}/{r['prompt_tokens']}  equal {r['tokens_equal_prefill']}")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    print(f"wrote {json_path}")
    if cross or wrong:
        print(f"FAILED: a stranger reused {cross} tokens; answers differing from prefill: {wrong}")
        return 1
    return 0


def _tenant(salt: str) -> str:
    from kvcodec.format.keys import tenant_id

    return tenant_id(salt)


def cmd_bench_tenants(args) -> int:
    return run(_settings(args), Path(args.model_repository), args.bandwidth_mbps, args.context_tokens, args.rung,
               args.runs, Path(args.json), args.link_mode, args.delay_ms)


def register(sub) -> None:
    """``kvcodec bench tenants`` under ``kvcodec bench``'s subcommands ``sub``."""
    p = sub.add_parser("tenants", help="TTFT with and without per-tenant encryption, and a stranger's reuse "
                                       "(starts link, store, server)")
    common(p)
    p.add_argument("--bandwidth-mbps", type=_list(float), default=[1000.0, 10000.0])
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--rung", default="int8-zstd", help="the rung both tenants' chunks are stored at")
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay of the link")
    p.add_argument("--link-mode", choices=["auto", "netns", "userspace"], default="auto")
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "tenants.json"))
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.set_defaults(func=cmd_bench_tenants)
