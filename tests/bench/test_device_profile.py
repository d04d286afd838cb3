"""The step profile's timeline split (tools/device_profile.py): busy time is the union of the
kernels' intervals, short idle gaps are one step's launch gaps, long ones the host's turn."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
_spec = importlib.util.spec_from_file_location(
    "device_profile", Path(__file__).resolve().parents[2] / "tools" / "device_profile.py")
assert _spec is not None and _spec.loader is not None
dp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dp)


def ev(name: str, a: float, b: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=a, end=b), device_type="DeviceType.CUDA")


def test_timeline_splits_busy_short_and_host_gaps():
    # two steps of 1,000 us each: kernels [0,400] [402,900] (overlapping [850,1000]), then the host
    # for 500 us, then the second step's kernels [1500,2500] with a 10 us gap inside
    evs = [ev("k", 0, 400), ev("k", 402, 900), ev("m", 850, 1000),
           ev("k", 1500, 2000), ev("m", 2010, 2500)]
    t = dp.timeline(evs, steps=2)
    assert t["gpu_busy_ms_per_step"] == pytest.approx((998 + 990) / 2 / 1e3)
    assert t["short_gaps_ms_per_step"] == pytest.approx((2 + 10) / 2 / 1e3)
    assert t["host_gaps_ms_per_step"] == pytest.approx(500 / 2 / 1e3)


def test_per_kernel_groups_by_name_and_counts_launches():
    rows, ms, n = dp.per_kernel([ev("_matvec", 0, 100), ev("_matvec", 200, 260), ev("Memcpy DtoH (Device -> Pageable)", 300, 310)], steps=2)
    assert rows[0] == {"name": "_matvec", "ms_per_step": 0.08, "launches_per_step": 1.0}
    assert rows[1]["name"] == "Memcpy DtoH" and ms == pytest.approx(0.085) and n == 1.5


def test_a_prefill_cell_rolls_back_to_its_depth_each_step(monkeypatch):
    """More rows than a verify block profile a prefill (eager): each step rolls the session back to
    its depth checkpoint and prefills the same tokens, so every step leaves the same cache length
    and the same last logits; the timed, profiled and host-profiled steps are each `steps` long.
    (The torch profiler and CUDA syncs are stubbed: the CPU build has no CUDA activity.)"""
    import numpy as np
    import torch

    from muser.engine import Engine

    class Profile:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def events(self):
            return [ev("_gemm", 0, 100), ev("_gemm", 120, 300)]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    eng = Engine.open(str(Path(__file__).resolve().parents[2] / "models" / "muse-glimmer-micro-q8_0.gguf"),
                      device="cpu")
    seen = []
    orig = eng.session

    def session(*a, **k):
        s = orig(*a, **k)
        pre = s.prefill
        s.prefill = lambda ids: seen.append((s.cache.n_tokens, len(ids), torch.as_tensor(pre(ids))[-1].clone()))
        return s

    monkeypatch.setattr(eng, "session", session)
    cell = dp.profile_cell(eng, 5, 40, 2, np.random.default_rng(0))
    assert cell["mode"] == "prefill" and cell["rows"] == 40 and len(cell["eager_wall_ms_samples"]) == 2
    assert cell["eager_launches_per_step"] == 1.0 and cell["eager_kernels"][0]["name"] == "_gemm"
    assert cell["eager_host"] and "graph_wall_ms_per_step" not in cell
    assert seen[0][:2] == (0, 5)  # the depth, once
    work = seen[1:]
    assert len(work) == 2 + 3 * 2 and all(w[:2] == (5, 40) for w in work)
    assert all(torch.equal(w[2], work[0][2]) for w in work)
