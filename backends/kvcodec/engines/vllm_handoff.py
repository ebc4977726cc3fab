"""Where the vLLM engine and its connector meet, in one process: the hand-off (``HANDOFF``, a
``connector.HandOff``) and what is posted in it per request (``Offer``), and the extra-config key
that says who posts (``MODE_KEY``). ``vllm_engine`` posts offers and ``vllm_connector`` reads them;
both import this module and it imports neither (nor vLLM), so the two form no circle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..connector import HandOff, LoadSession
from ..connector.worker import SaveSink

HANDOFF = HandOff()
MODE_KEY = "kvcodec.offers"  # kv_connector_extra_config: "ensemble" (the llm step posts offers) or absent
ENSEMBLE = "ensemble"  # MODE_KEY's value when the engine (the ensemble's llm step) posts the offers


@dataclass
class Offer:
    """What the ``llm`` step offers the connector for one request."""

    session: Optional[LoadSession] = None  # the restored chunks of the prompt's first tokens
    chunk_tokens: int = 256
    save: Optional[SaveSink] = None  # receives the prompt's full chunks not served from the session
    promised_tokens: int = 0  # filled in by the connector
    loaded_tokens: int = 0
    asynchronous: bool = False
    defer: bool = False  # chunks still coming: ask again later, load once they are in (no asynchronous load)
    load_s: float = 0.0
    save_s: float = 0.0
    saved_chunks: int = 0
    own: bool = False  # made by the connector itself (standalone): it removes it when the request ends
