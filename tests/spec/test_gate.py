"""The acceptance gate: windowed, warm-up skipped, proposal floor, doubling cooldown, never a latch."""

from __future__ import annotations

from muser.spec.gate import AcceptanceGate


def _rounds(g, n, proposed, accepted, t0=0):
    for i in range(n):
        g.record(proposed, accepted, t0 + i)


def test_needs_warmup_window_and_floor():
    g = AcceptanceGate()
    _rounds(g, 2, 7, 0)  # warm-up rounds are not judged
    _rounds(g, 7, 7, 0)  # 7 of the 8 window rounds
    assert g.open
    _rounds(g, 1, 7, 0)  # the 8th: 56 proposals, rate 0
    assert not g.open and g.transitions[-1]["event"] == "close" and g.transitions[-1]["cooldown"] == 64
    g2 = AcceptanceGate()
    _rounds(g2, 2 + 8, 3, 0)  # 8 rounds x 3 = 24 proposals < 32: no judgement
    assert g2.open
    _rounds(g2, 3, 3, 0)  # 11 rounds of 3 in the window? the window holds 8 rounds = 24: still none
    assert g2.open


def test_threshold_is_windowed_not_cumulative():
    g = AcceptanceGate()
    _rounds(g, 2, 15, 0)
    _rounds(g, 8, 15, 3)  # 0.2 < 0.25 closes
    assert not g.open
    g = AcceptanceGate()
    _rounds(g, 2, 15, 0)
    _rounds(g, 8, 15, 4)  # 0.267 stays open
    assert g.open
    _rounds(g, 20, 15, 15)  # a long good stretch ...
    _rounds(g, 6, 15, 0)
    assert g.open  # ... then 6 bad: the window holds 30/120 = 0.25, not below
    _rounds(g, 1, 15, 0)
    assert not g.open  # 15/120 closes, though the cumulative rate is still above 0.5


def test_cooldown_doubles_and_requalifies():
    g = AcceptanceGate()
    seen = []
    for _ in range(5):
        _rounds(g, 10, 15, 0)
        assert not g.open
        seen.append(g.transitions[-1]["cooldown"])
        n = 0
        while not g.open:
            g.plain_token(n)
            n += 1
        assert n == seen[-1] and g.transitions[-1]["event"] == "open"
    assert seen == [64, 128, 256, 512, 512]
    _rounds(g, 10, 15, 15)  # a qualification that passes resets the cooldown
    assert g.open and g.cooldown == 64


def test_close_below_is_the_threshold_and_zero_holds_it_open():
    import pytest

    from muser.errors import LaneError

    g = AcceptanceGate(close_below=0.0)  # every round drafts: the schedule of an ungated driver
    _rounds(g, 2 + 40, 7, 0)
    assert g.open and g.transitions == []
    g = AcceptanceGate(close_below=0.5)
    _rounds(g, 2 + 8, 15, 6)  # 0.4: open under the book's 0.25, closed under 0.5
    assert not g.open
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(LaneError, match="close_below"):
            AcceptanceGate(close_below=bad)
