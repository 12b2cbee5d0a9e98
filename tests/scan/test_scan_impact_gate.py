"""The impact gate on intermittent suspects: judged on the iterations they slow, not the mean."""

from __future__ import annotations

from megatronapp.scan.analyze.detect_config import DetectConfig, DetectionReport, Suspect
from megatronapp.scan.analyze.detect_output import nothing_found_text
from megatronapp.scan.analyze.impact_gate import apply_impact_gate, gated_share


def _intermittent(saving_ms: float, slow: int, of: int) -> Suspect:
    evidence = {"summary": "s", "intermittent": True, "slow_iterations": list(range(slow)), "iterations": of}
    return Suspect(1, {}, "slow_compute", 0.9, evidence, None, 100e6, 100e6 - saving_ms * 1e6)


def _report(*suspects: Suspect) -> DetectionReport:
    return DetectionReport(suspects, tuple(range(20)), 100e6, 100e6, 0.0, 4, {}, (), ())


def test_an_intermittent_fault_costing_3_percent_on_average_but_15_where_it_strikes_is_named():
    s = _intermittent(3.0, slow=4, of=20)  # 4 of 20 iterations, 15 ms each: 3 ms a mean iteration
    assert abs(gated_share(s) - 0.15) < 1e-9
    assert apply_impact_gate(_report(s), DetectConfig()).suspects == (s,)


def test_an_intermittent_fault_small_even_where_it_strikes_is_held_back_and_both_shares_are_said():
    s = _intermittent(0.8, slow=4, of=20)  # 4% in the iterations it slows
    gated = apply_impact_gate(_report(s), DetectConfig())
    assert gated.suspects == () and gated.below_impact == (s,)
    assert "(0.8%; 4.0% in the iterations it slows)" in nothing_found_text(gated)


def test_a_constant_suspect_is_judged_on_its_mean_share():
    s = Suspect(1, {}, "slow_compute", 0.9, {"summary": "s", "iterations": 20}, None, 100e6, 97e6)
    assert abs(gated_share(s) - 0.03) < 1e-9
    assert apply_impact_gate(_report(s), DetectConfig()).suspects == ()
