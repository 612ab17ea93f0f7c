"""The serving-metric definitions on hand-made timestamps, against the field's formulas."""

from __future__ import annotations

import math

import pytest

from cluster.slo import RequestTiming, SLOWindow, Targets, goodput, percentile, summarize


def test_ttft_tpot_e2e_and_itl():
    # Sent at 10.0; tokens arrive at 10.5 (1), 10.6 (1), 10.9 (2), 11.0 (1): five output tokens.
    t = RequestTiming(10.0, ((10.5, 1), (10.6, 1), (10.9, 2), (11.0, 1)))
    assert t.output_tokens == 5
    assert t.ttft == pytest.approx(0.5)
    assert t.e2e == pytest.approx(1.0)
    assert t.tpot == pytest.approx((1.0 - 0.5) / (5 - 1))  # (E2E - TTFT) / (n - 1)
    assert t.itl == pytest.approx([0.1, 0.3, 0.1])


def test_single_token_requests_have_no_tpot_and_count_for_ttft_only():
    t = RequestTiming(0.0, ((0.2, 1),))
    assert t.tpot is None and t.itl == []
    assert Targets(0.3, 0.01).met(t.ttft, t.tpot)
    assert not Targets(0.1, 1.0).met(t.ttft, t.tpot)


def test_goodput_counts_requests_meeting_both_targets_per_second():
    fast = RequestTiming(0.0, ((0.1, 1), (0.2, 1), (0.3, 1)))  # ttft 0.1, tpot 0.1
    slow_first = RequestTiming(0.0, ((0.9, 1), (1.0, 1)))  # ttft 0.9
    slow_decode = RequestTiming(0.0, ((0.1, 1), (1.1, 1)))  # tpot 1.0
    targets = Targets(ttft_s=0.5, tpot_s=0.2)
    assert goodput([fast, slow_first, slow_decode, fast], targets, duration_s=4.0) == pytest.approx(2 / 4)


def test_percentiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.0 + 0.6 * 6.0)  # numpy.percentile(values, 90) = 7.6
    assert percentile(values, 99) == pytest.approx(4.0 + 0.96 * 6.0)
    s = summarize(values)
    assert s["mean"] == 4.0 and s["median"] == 3.0
    assert math.isnan(summarize([])["p99"])


def test_slo_window_slides():
    now = [0.0]
    window = SLOWindow(10.0, clock=lambda: now[0])
    assert window.attainment() is None
    window.record(True)
    now[0] = 5.0
    window.record(False)
    assert window.attainment() == 0.5
    now[0] = 12.0  # the first request left the window
    assert window.attainment() == 0.0
    now[0] = 30.0
    assert window.attainment() is None
