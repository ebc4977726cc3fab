"""vLLM's KV connector (``KVConnectorBase_V1``) over the engine-neutral core (``kvcodec.connector``);
call by call: docs/development/connectors.md.

Restored KV reaches vLLM's paged cache through an in-process hand-off (``connector.HandOff``):
an ``Offer`` per request (its ``LoadSession``, its write-back sink) is posted by the ensemble's
``llm`` step (``kv_connector_extra_config`` ``{"kvcodec.offers": "ensemble"}``) or, in ``vllm
serve``, made by the scheduler half itself (``connector.standalone.OwnOffers``; settings from
``kv_connector_extra_config`` or ``KVCODEC_*``, the model vLLM's local folder).

- scheduler side (``connector.SchedulerCore``): ``get_num_new_matched_tokens`` answers from the
  session (asynchronous while chunks come, "ask again later" while deferred or planning,
  synchronous once settled), ``update_state_after_alloc`` attaches the blocks, and
  ``build_connector_meta`` names the step's loads and saves;
- worker side (``connector.WorkerCore``): ``register_kv_caches`` (``KVPages``), ``get_finished`` and
  ``get_block_ids_with_load_errors`` (promised blocks not written: vLLM recomputes them,
  ``kv_load_failure_policy="recompute"``), ``wait_for_save`` (full chunks to the offer's sink);
- metrics: ``get_kv_connector_stats`` / ``build_prom_metrics`` (``vllm_metrics``).
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ..connector import KVPages, Load, SaveJob, SchedulerCore, WorkerCore
from ..connector.standalone import PENDING, OwnOffers
from ..connector.worker import SaveSink
from . import vllm_metrics
from .vllm_engine import VllmEngine
from .vllm_handoff import ENSEMBLE, HANDOFF, MODE_KEY

log = logging.getLogger("kvcodec.vllm")


def standalone(settings, card) -> OwnOffers:
    """The scheduler half's own offers in ``vllm serve`` (``connector.standalone``), on the
    deployment's reads and writes (``kvcodec.compose``), its metrics vLLM's (``vllm_metrics``)."""
    from ..compose import open_reads, open_writes
    from ..serving.readpath import ReadPath

    metrics = vllm_metrics.ConnectorMetrics()
    return OwnOffers(ReadPath(open_reads(settings, card), observer=metrics.record), open_writes(settings, card),
                     HANDOFF, settings.chunk_tokens, metrics)


def request_salt(request) -> str:
    """vLLM's ``Request.cache_salt`` (the OpenAI request's ``cache_salt``), "" when unsalted: the
    tenant whose chunks alone the request may read and write (``format.keys``), as vLLM keeps its
    own prefix cache apart by it."""
    return str(getattr(request, "cache_salt", None) or "")


def standalone_settings(vllm_config):
    """The connector's settings in ``vllm serve``: ``kv_connector_extra_config`` (settings names), else
    ``KVCODEC_*``; the model is vLLM's (a local folder). None in the ensemble (the engine's offers)."""
    from pathlib import Path

    from ..errors import ConfigError
    from ..settings import Settings

    transfer = vllm_config.kv_transfer_config
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    if extra.pop(MODE_KEY, "") == ENSEMBLE:
        return None
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    if backend not in ("uni", None):
        raise ConfigError(f"KVCodecConnector's scheduler and worker halves meet in one process: start vLLM with "
                          f"--distributed-executor-backend uni (got {backend!r})")
    if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
        raise ConfigError('KVCodecConnector needs "kv_load_failure_policy": "recompute" in --kv-transfer-config: '
                          "a chunk that fails after its tokens were promised is then recomputed by vLLM, not "
                          "failed")
    model = Path(str(vllm_config.model_config.model)).expanduser()
    if not (model / "config.json").is_file():
        raise ConfigError(f"KVCodecConnector needs the served model as a local folder (its identity keys the "
                          f"stored chunks), got {vllm_config.model_config.model!r}")
    explicit = {k: str(v) for k, v in extra.items()}
    explicit.setdefault("model", str(model))
    explicit["engine"] = "vllm"
    return Settings.load(explicit)


class KVCodecStats(KVConnectorStats):
    """One interval of ``vllm_metrics.ConnectorMetrics`` (its ``interval()`` payload)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVCodecStats":
        return KVCodecStats(data=vllm_metrics.aggregate(self.data, other.data))

    def reduce(self) -> Dict[str, Any]:
        return vllm_metrics.summary(self.data)

    def is_empty(self) -> bool:
        return vllm_metrics.is_empty(self.data)


class KVCodecPromMetrics(KVConnectorPromMetrics):
    """The connector's families on the API server's ``/metrics`` (``vllm_metrics.PromFamilies``)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.families = vllm_metrics.PromFamilies(metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        self.families.observe(transfer_stats_data, engine_idx)


@dataclass
class KVCodecMetadata(KVConnectorMetadata):
    loads: List[Load] = field(default_factory=list)
    saves: List[SaveJob] = field(default_factory=list)


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    return int(found[0]) if found else 0


class KVCodecConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        model = vllm_config.model_config
        self.kv_heads = int(model.get_total_num_kv_heads())
        self.head_dim = int(model.get_head_size())
        # each offer names its chunk size (the engine's settings)
        self.core: SchedulerCore = SchedulerCore(int(vllm_config.cache_config.block_size), 256)
        self._attached: List[Load] = []  # attached since the last metadata
        self.worker = WorkerCore()
        self._load_errors: Set[int] = set()
        self.standalone: Optional[OwnOffers] = None
        if role == KVConnectorRole.SCHEDULER:
            settings = standalone_settings(vllm_config)
            if settings is not None:
                card = VllmEngine.model_card(settings)
                self.standalone = standalone(settings, card)
                self.core = SchedulerCore(int(vllm_config.cache_config.block_size), settings.chunk_tokens)
                log.info("kvcodec connector (standalone): store %s, ladder %s, chunks of %d tokens, model %s",
                         settings.store, ",".join(settings.ladder), settings.chunk_tokens, card.model_id)

    @property
    def block_size(self) -> int:
        return self.core.block_size

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        given, offer = HANDOFF.find(request.request_id)
        if offer is None and self.standalone is not None:
            offer = self.standalone.offer(request.request_id, request.prompt_token_ids or [], request_salt(request),
                                          num_computed_tokens)
            given = request.request_id
            if offer is PENDING:
                return None, False  # vLLM keeps the request waiting and asks again at its next step
        if offer is None:
            return 0, False
        prompt = len(request.prompt_token_ids or [])
        session = offer.session
        settled = session is None or session.settled
        if not settled and offer.defer and session.bound_tokens:
            return None, False  # vLLM keeps the request waiting and asks again at its next step
        stored = 0 if session is None else (session.staged_tokens if settled else session.bound_tokens)
        save = {"given": given} if offer.save is not None else None
        n = self.core.match(request.request_id, prompt, stored, num_computed_tokens, session,
                            asynchronous=not settled, save=save, chunk_tokens=offer.chunk_tokens, given=given)
        if n:
            offer.promised_tokens, offer.asynchronous = n, not settled
        return n, bool(n) and not settled

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        load = self.core.allocated(request.request_id, list(blocks.get_block_ids()[0]))
        if num_external_tokens <= 0 or load is None:
            return
        offer = HANDOFF.get(load.extra["given"])
        if offer is None:
            return
        load.tokens = num_external_tokens
        t = time.perf_counter()
        load.session.attach(HANDOFF.pages, load.block_ids, load.start, load.tokens)
        offer.load_s += time.perf_counter() - t
        self._attached.append(load)

    def build_connector_meta(self, scheduler_output) -> KVCodecMetadata:
        meta = KVCodecMetadata(loads=self._attached)
        self._attached = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            job = self.core.scheduled(new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0),
                                      new.block_ids[0], first=True)
            if job is not None:
                meta.saves.append(job)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            added = cached.new_block_ids[i] if cached.new_block_ids else None
            job = self.core.scheduled(req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0),
                                      added[0] if added else ())
            if job is not None:
                meta.saves.append(job)
        return meta

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self.core.finished(request.request_id)
        if self.standalone is not None:
            self.standalone.finished(request.request_id)
        return False, None

    def shutdown(self):
        if self.standalone is not None:
            self.standalone.close()

    # -- metrics: from the engine core to the API server's /metrics (vllm_metrics) ---------------
    def get_kv_connector_stats(self) -> Optional["KVCodecStats"]:
        if self.standalone is None:  # the ensemble's llm step exports its own (Triton's metrics)
            return None
        stats = KVCodecStats(data=self.standalone.metrics.interval())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> "KVCodecStats":
        return KVCodecStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVCodecPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        from vllm.platforms import current_platform

        layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_index)]
        # vLLM 0.32 hands every backend's layer as [blocks, heads, block_size, 2*head_dim]; the CPU
        # kernel stores K transposed in it (measured), the GPU backends one token's [K|V] per row
        # (flash_attn.py splits the last dim; not run here: no GPU build of vLLM on these machines)
        layout = "cpu_attn" if current_platform.is_cpu() else "token_kv"
        pages = KVPages.from_vllm(layers, self.kv_heads, self.head_dim, block_size=self.block_size, layout=layout)
        self.worker.register(pages)
        HANDOFF.pages = pages
        log.info("kvcodec connector: %d layers, %d blocks of %d tokens, %s", pages.layers,
                 pages.num_blocks, pages.block_size, pages.dtype)

    @property
    def pages(self) -> Optional[KVPages]:
        return self.worker.pages

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        for load in self._get_connector_metadata().loads:
            self.worker.begin(load)  # written by the session as the chunks arrive

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        self.worker.save(self._get_connector_metadata().saves, self._sink_for)

    def _sink_for(self, job: SaveJob) -> Optional[SaveSink]:
        offer = HANDOFF.get(job.extra["given"])
        return None if offer is None else offer.saver()

    def get_finished(self, finished_req_ids):
        """Loads whose session is loaded: asynchronous ones are reported as received; every one whose
        blocks fell short of the promise has them named by ``get_block_ids_with_load_errors``."""
        finished = self.worker.finished()
        for load in finished.ended:
            offer = HANDOFF.get(load.extra["given"])
            if offer is not None:
                offer.loaded_tokens = load.session.loaded_tokens
        self._load_errors.update(finished.failed_blocks)
        return None, (finished.done or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
