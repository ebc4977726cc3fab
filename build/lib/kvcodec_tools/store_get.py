"""Chunk GET throughput of the S3 store (SeaweedFS) against the HTTP store (nginx), on the same link.

Both servers run behind one throttled link (``kvcodec_tools.shaping``: a network namespace shaped
with tc when this process may make one, else the userspace proxy; ``--rate-mbit 0``: loopback,
unshaped). The same objects (``--objects`` of ``--object-mb`` MB, random bytes, chunk-sized) are
put into each store; then, per store and per number of reader threads, every object is read
``--rounds`` times through the product's store client (``open_store``), each read checked
against what was put. Reported: MB/s (payload bytes over wall time) and the median GET latency.
Writes ``perf/results/store_get.json``; exits non-zero on a wrong byte.

    python -m kvcodec_tools.store_get [--rate-mbit 1000] [--threads 1,4] [--json perf/results/store_get.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

from kvcodec_tools.ports import free_port_run, free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]


def _read_all(store, keys: List[str], values: Dict[str, bytes], threads: int, rounds: int) -> dict:
    latencies: List[float] = []

    def one(key: str) -> int:
        t = time.perf_counter()
        data = store.get(key)
        latencies.append(time.perf_counter() - t)
        if data != values[key]:
            raise SystemExit(f"store_get: {store.url} returned wrong bytes for {key}")
        return len(data)

    work = [k for _ in range(rounds) for k in keys]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, work))
    wall = time.perf_counter() - t0
    return {"threads": threads, "gets": len(work), "bytes": total, "wall_s": round(wall, 4),
            "mb_per_s": round(total / wall / 1e6, 1), "get_ms_median": round(statistics.median(latencies) * 1e3, 2)}


def run(rate_mbit: float, delay_ms: float, mode: str, objects: int, object_mb: float, threads: List[int],
        rounds: int) -> dict:
    from kvcodec.store import open_store
    from kvcodec.store.http import HttpStore
    from kvcodec_tools.services.nginx import NginxStore
    from kvcodec_tools.services.seaweedfs import PORTS, SeaweedS3
    from kvcodec_tools.shaping import open_link

    size = int(object_mb * 1e6)
    values = {f"bench0store/get00bench/{i:040x}": os.urandom(size) for i in range(objects)}
    keys = list(values)
    token, access, secret = secrets.token_hex(16), "bench-" + secrets.token_hex(4), secrets.token_hex(16)
    out: dict = {"objects": objects, "object_bytes": size, "rounds": rounds, "results": {}}
    with tempfile.TemporaryDirectory(prefix="store-get-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        link = stack.enter_context(open_link(rate_mbit, delay_ms, mode)) if rate_mbit > 0 else None
        host = link.server_host if link else "127.0.0.1"
        wrap = link.wrap if link else None
        out["link"] = link.describe() if link else {"kind": "loopback", "rate_mbit": None}
        (nginx_port,) = free_ports(1)
        base = free_port_run(len(PORTS), offsets=(0, 10000))
        nginx = stack.enter_context(NginxStore(root / "nginx", host, nginx_port, token, wrap=wrap, workers=2))
        weed = SeaweedS3(root / "s3", host, access, secret, bucket="kvbench", base_port=base, wrap=wrap)
        stack.enter_context(weed.start(timeout_s=90))
        if link:
            h, p = link.expose(nginx_port)
            nginx_url = f"http://{h}:{p}/kv"
            h3, p3 = link.expose(weed.port)
            endpoint = f"http://{h3}:{p3}"
        else:
            nginx_url, endpoint = nginx.url, weed.endpoint
        os.environ.update(weed.environ(), AWS_ENDPOINT_URL_S3=endpoint)
        stores = {"nginx (http)": HttpStore(nginx_url, token=token),
                  "seaweedfs (s3)": open_store(weed.url + f"?pool={max(threads) + 2}")}
        for name, store in stores.items():
            for k in keys:
                store.put(k, values[k])
            _read_all(store, keys[:2], values, 1, 1)  # warm: connections made
            out["results"][name] = [_read_all(store, keys, values, n, rounds) for n in threads]
            store.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcodec_tools.store_get", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate (0: loopback, unshaped)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of the link")
    p.add_argument("--mode", default="auto", choices=("auto", "netns", "userspace"))
    p.add_argument("--objects", type=int, default=16)
    p.add_argument("--object-mb", type=float, default=2.0, help="object size (a 256-token chunk of a compressed "
                                                                 "rung is 0.3-2 MB)")
    p.add_argument("--threads", default="1,4", help="reader threads, a comma list")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "store_get.json"))
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    runs = [run(args.rate_mbit, args.delay_ms, args.mode, args.objects, args.object_mb, threads, args.rounds)]
    if args.rate_mbit > 0:
        runs.append(run(0, 0, "auto", args.objects, args.object_mb, threads, args.rounds))  # the servers' own cost
    report = {"what": "chunk GET throughput through the kvcodec store clients: S3 (SeaweedFS, boto3) vs "
                      "HTTP (nginx), same objects, same link", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpus": os.cpu_count(), "runs": runs}
    for r in runs:
        print(f"link {r['link'].get('kind')} {r['link'].get('rate_mbit')} Mbit/s:")
        for name, rows in r["results"].items():
            for row in rows:
                print(f"  {name:<16} threads {row['threads']}: {row['mb_per_s']:>7.1f} MB/s, "
                      f"GET median {row['get_ms_median']:.1f} ms")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
