"""The peers' workloads against the peers bench's methods, side by side in one run: ``kvcodec bench
workload long-doc-qa|multi-round --peers M1,M2 --link-mbps 100,10000``.

For each link rate and each method (``peers.method_server``'s: ``prefill`` is plain ``vllm serve``
with its prefix cache on, ``lmcache`` / ``lmcache-fp8`` vLLM with LMCache's multiprocess server and
the store as its L2, ``kvcodec-vllm-serve`` the KVCodec connector, ``kvcodec-ensemble`` the Triton
ensemble), a fresh store (``peers_stores.store_behind_link``: Redis or SeaweedFS's S3 behind a
shaped link at that rate) and the method's server; the workload runs through ``ServerTarget``, and
with ``restart`` the server (and LMCache's server: its RAM tier) is replaced between the rounds on
the same store, once what the warm-up wrote has settled (``PeersStore.settle``). Every answer is
checked against one reference server's (plain vLLM, its prefix cache off: prefill), started once
for the run. A row per (method, rate) into the rows file (``workload.make_row``), ``method`` the
peers bench's name.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .workload_run import Answer, EnsembleTarget


class ServerTarget:
    """A peers server (``VllmServe`` or ``peers_servers.EnsembleServer``: both have ``streamed``) as a
    workload target; ``reference(prompt, max_tokens)``: prefill's answer, from ``reference``. The
    ensemble is sent to through Triton's HTTP ``generate_stream`` (``EnsembleTarget``), as a client
    of the peers' scripts would (the peers bench uses its gRPC stream)."""

    url = "peers"

    def __init__(self, server, reference: Callable[[str, int], str]) -> None:
        self.server, self._reference = server, reference
        http = getattr(server, "http_url", None)
        self._ensemble = EnsembleTarget(http) if http else None

    def send(self, prompt: str, max_tokens: int, salt: Optional[str] = None, route: Optional[str] = None) -> Answer:
        if self._ensemble is not None:
            return self._ensemble.send(prompt, max_tokens, salt)
        t0 = time.perf_counter()
        out = self.server.streamed(prompt, max_tokens, **({"cache_salt": salt} if salt else {}))
        elapsed = out.get("elapsed_s") or time.perf_counter() - t0
        return Answer(out["ttft_s"], out["text"], out.get("cached_tokens"), elapsed)

    def reference(self, prompt: str, max_tokens: int) -> str:
        return self._reference(prompt, max_tokens)


class MethodServers:
    """One method's servers on one store: ``start()`` enters ``open_server()`` (a context manager
    yielding the server) and returns its target, closing the one before (after ``settle()``);
    ``close()`` ends the last. ``writeback``: the KVCodec servers' write-back jobs by state
    (``kvcodec_writeback_total``: queued, stored, dropped, failed, skipped), summed over the servers,
    each read once its stores have settled; empty for the others."""

    def __init__(self, open_server: Callable[[int], object], settle: Callable[[], None],
                 reference: Callable[[str, int], str]) -> None:
        self.open_server, self.settle, self.reference = open_server, settle, reference
        self.starts, self._open, self._server = 0, None, None
        self.writeback: Dict[str, int] = {}

    def start(self) -> ServerTarget:
        self.close(settle=True)
        self._open = self.open_server(self.starts)
        self._server = self._open.__enter__()
        self.starts += 1
        self._server.streamed("Hello", 1)  # the server's one-time costs, nothing stored
        return ServerTarget(self._server, self.reference)

    def close(self, settle: bool = False) -> None:
        if self._open is not None:
            if settle:
                self.settle()  # write-back / LMCache's store to L2 ends off the requests' path
            self._count_writeback()
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)

    def _count_writeback(self) -> None:
        from .services.vllm_serve import by_label

        read = getattr(self._server, "metrics_text", None)
        if read is None:
            return
        try:
            self._server.streamed("Hello", 1)  # Triton updates its counters at a request's end
            counts = by_label(read(), "kvcodec_writeback_total", "state")
        except OSError as exc:
            print(f"  write-back counts not read: {exc}", file=sys.stderr, flush=True)
            return
        for state, n in counts.items():
            self.writeback[state] = self.writeback.get(state, 0) + n


def run_peers(args, config, tokenizer, model: Path, work: Path, run, log=print) -> List[dict]:
    """The rows of ``args.peers`` x ``args.link_mbps`` (``run``: ``workload_run.run_long_doc_qa`` or
    ``run_multi_round``, ``config`` its config)."""
    from .peers import PeersConfig, method_parts, method_server
    from .peers_servers import VLLM_PYTHON, one_port
    from .peers_stores import store_behind_link
    from .procstats import Footprint
    from .services.vllm_serve import VllmServe
    from .workload import make_row
    from .workload_run import config_dict

    methods = list(args.peers)
    for method in methods:
        method_parts(method)  # a ValueError naming the methods
    pc = PeersConfig(bandwidths=list(args.link_mbps), methods=methods, delay_ms=args.delay_ms,
                     link_mode=args.link_mode, store=args.peers_store)
    rows = []
    with VllmServe(model, work / "reference", {}, one_port(), connector=False, prefix_cache=False,
                   python=VLLM_PYTHON) as reference:
        def prefill(prompt: str, max_tokens: int) -> str:
            return reference.streamed(prompt, max_tokens)["text"]

        for rate in pc.bandwidths:
            for method in methods:
                root = work / f"{method.replace(':', '-')}-{rate:g}"
                log(f"workload {args.workload}: {method} at {rate:g} Mbit/s (a fresh {pc.store} store behind the link)")
                with store_behind_link(root, rate, pc) as (store, _link):
                    footprint = Footprint()

                    def open_server(n: int, method=method, root=root, store=store, footprint=footprint):
                        return method_server(method, model, root / f"start-{n}", store, pc, True, footprint)

                    servers = MethodServers(open_server, store.settle, prefill)
                    try:
                        records, times = run(servers.start(), tokenizer, config,
                                             restart=servers.start if args.restart_between_rounds else None,
                                             progress=not args.no_progress)
                    finally:
                        servers.close(settle=True)
                details = {**config_dict(config), "target": f"peers: {method}", "store": pc.store,
                           "delay_ms": pc.delay_ms, "servers": servers.starts}
                if servers.writeback:  # what write-back did under the run's load: stored, or dropped and why
                    details["writeback"] = servers.writeback
                row = make_row(args.workload, method, rate, args.restart_between_rounds, records, details, **times)
                print(f"  {method} @ {rate:g} Mbit/s: warm-up {row['warmup_ttft_mean_s']} s, query "
                      f"{row['query_ttft_mean_s']} s, gain {row['ttft_gain']}, answers equal {row['answers_equal']}",
                      file=sys.stderr, flush=True)
                rows.append(row)
    return rows
