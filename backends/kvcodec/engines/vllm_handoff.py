"""Where the vLLM engine and its connector meet, in one process: the hand-off (``HANDOFF``, a
``connector.HandOff``) where a ``connector.handoff.Offer`` is posted per request, and the extra-config key
that says who posts (``MODE_KEY``). ``vllm_engine`` posts offers and ``vllm_connector`` reads them;
both import this module and it imports neither (nor vLLM), so the two form no circle.
"""
from __future__ import annotations

from ..connector.handoff import HandOff, Offer

__all__ = ["ENSEMBLE", "HANDOFF", "MODE_KEY", "Offer"]

HANDOFF = HandOff()
MODE_KEY = "kvcodec.offers"  # kv_connector_extra_config: "ensemble" (the llm step posts offers) or absent
ENSEMBLE = "ensemble"  # MODE_KEY's value when the engine (the ensemble's llm step) posts the offers
