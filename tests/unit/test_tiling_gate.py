"""The frames comparison's gate (``kvcodec_tools.tiling.gate``): the tiled rung passes only with
rd's own quality gate, >= 97% of the old frames' ratio and >= 97% of their task accuracy, both
measured."""
from kvcodec_tools.tiling import gate


def _rd(new_ratio=6.0, new_gate=True):
    return {"old": {"ratio_vs_fp16": 5.9, "gate": True}, "new": {"ratio_vs_fp16": new_ratio, "gate": new_gate}}


def _task(new=0.975):
    return {"old": {"accuracy_codec": 0.975}, "new": {"accuracy_codec": new}}


def test_a_rung_within_3_percent_that_passes_rds_gate_passes():
    out = gate(_rd(5.9 * 0.975), _task(0.975 * 0.98))
    assert out["pass"] and out["ratio_new_over_old"] == 0.975


def test_each_condition_fails_it_alone():
    assert not gate(_rd(new_gate=False), _task())["pass"]  # rd's quality gate (KL, top-1)
    assert not gate(_rd(5.9 * 0.96), _task())["pass"]  # 4% below the old frames' ratio
    assert not gate(_rd(), _task(0.975 * 0.96))["pass"]  # 4% below their task accuracy


def test_an_unmeasured_part_is_no_pass():
    assert not gate(_rd(), None)["pass"] and not gate(None, _task())["pass"]
    assert gate(_rd(), None)["measured"] == {"rd": True, "task": False}
