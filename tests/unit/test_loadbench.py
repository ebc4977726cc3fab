"""``kvcodec bench load``'s bookkeeping: the per-variant checks (reuse TTFT over prefill's, throughput
over the wait variant's) and its configuration's refusals."""
from __future__ import annotations

import pytest

from kvcodec_tools.loadbench import VARIANTS, LoadConfig, checks, variant_settings


def _row(variant, clients, mode, ttft, rps=None):
    return {"variant": variant, "clients": clients, "mode": mode, "ttft_p50_s": ttft, "requests_per_s": rps}


def test_checks_compare_reuse_with_prefill_and_each_variant_with_wait():
    rows = [_row("wait", 4, "all", 3.0, 1.0), _row("wait", 4, "reuse", 4.4), _row("wait", 4, "prefill", 4.3),
            _row("stream-sliced", 4, "all", 2.0, 1.1), _row("stream-sliced", 4, "reuse", 1.5),
            _row("stream-sliced", 4, "prefill", 5.0)]
    got = {c["variant"]: c for c in checks(rows)}
    assert got["wait"]["reuse_vs_prefill_ttft"] == round(4.4 / 4.3, 3) and got["wait"]["throughput_vs_wait"] == 1.0
    assert got["stream-sliced"]["reuse_vs_prefill_ttft"] == 0.3
    assert got["stream-sliced"]["throughput_vs_wait"] == 1.1


def test_the_variants_are_settings_and_bad_configs_are_refused():
    from kvcodec.settings import Settings

    for name, values in VARIANTS.items():  # every variant is a valid set of settings
        s = Settings.load({k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in values.items()}, env={})
        assert s.stream_loads == values["stream_loads"], name
    with pytest.raises(ValueError, match="variants"):
        LoadConfig([1], ["fast"])
    with pytest.raises(ValueError, match="bandwidth"):
        LoadConfig([1], ["wait"], bandwidth_mbps=0)
    with pytest.raises(ValueError, match="SLICE <= STEP"):
        LoadConfig([1], ["stream@128/512"])
    with pytest.raises(ValueError, match="token counts"):
        LoadConfig([1], ["stream@big/256"])


def test_a_variant_at_other_sizes_keeps_its_load_path():
    got = variant_settings("stream-queued@1024/256")
    assert got == dict(VARIANTS["stream-queued"], step_tokens=1024, prefill_slice=256)
    assert got["async_loads"] is False and variant_settings("wait") == VARIANTS["wait"]
