"""The fused element-wise tails (kernels/fused.py) against the torch op chains of
engine/forward.py, run by the Triton interpreter (compiled and gated on the GPU machine)."""

from __future__ import annotations

import importlib

import pytest
import torch

from muser.engine import forward as F


@pytest.fixture(scope="module")
def fk(kernels):
    from muser.engine.kernels import fused

    return importlib.reload(fused)


def _close(a, b, rel=2e-6):
    return float((a - b).abs().max()) <= rel * max(1.0, float(b.abs().max()))


def test_norm_mul_matches_torch(fk):
    g = torch.Generator().manual_seed(0)
    for R, N in ((1, 512), (3, 6656), (2, 100)):
        x = torch.randn(R, N, generator=g) * 3
        w = 1 + 0.1 * torch.randn(N, generator=g)
        res = torch.randn(R, N, generator=g)
        assert _close(fk.norm_mul(x, w, 1e-5), F.rms_norm(x, 1e-5) * w)
        assert _close(fk.norm_mul(x, w, 1e-8, res=res), F.rms_norm(x, 1e-8) * w + res)


def test_qk_norm_rope_matches_torch(fk):
    g = torch.Generator().manual_seed(1)
    T, H, KV, D = 3, 4, 2, 32
    y = torch.randn(T, 5 + H * D + KV * D + 7, generator=g)
    q0, k0 = 5, 5 + H * D
    qn, kn = 1 + 0.1 * torch.randn(D, generator=g), torch.ones(D)
    c, s = (torch.from_numpy(a) for a in F.rope_tables(16, D, 10000.0))
    pos = torch.tensor([3, 9, 15])
    cos, sin = c[pos].contiguous(), s[pos].contiguous()
    for rope in (False, True):
        q, k = fk.qk_norm_rope(y, q0, k0, H, KV, D, qn, kn, 1e-5, cos if rope else None, sin if rope else None)
        rq = F.rms_norm(y[:, q0:q0 + H * D].reshape(T, H, D), 1e-5) * qn
        rk = F.rms_norm(y[:, k0:k0 + KV * D].reshape(T, KV, D), 1e-5) * kn
        if rope:
            rq, rk = F.rope(rq, cos, sin), F.rope(rk, cos, sin)
        assert q.is_contiguous() and k.is_contiguous()
        assert _close(q, rq) and _close(k, rk)


def test_gate_and_silu_match_torch(fk):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 3000, generator=g) * 4, torch.randn(2, 3000, generator=g) * 4
    assert _close(fk.gate_mul(a, b), a * F.sigmoid(b))
    assert _close(fk.silu_mul(b, a), F.silu(b) * a)
    wide = torch.randn(2, 6000, generator=g)
    assert _close(fk.silu_mul(wide[:, :3000], wide[:, 3000:]), F.silu(wide[:, :3000]) * wide[:, 3000:])


def test_norm2_matches_torch(fk):
    g = torch.Generator().manual_seed(3)
    for R, N in ((1, 6656), (3, 512)):
        x, res = torch.randn(R, N, generator=g) * 2, torch.randn(R, N, generator=g)
        w, w2 = 1 + 0.1 * torch.randn(N, generator=g), 1 + 0.1 * torch.randn(N, generator=g)
        h, x2 = fk.norm2(x, w, 1e-8, res, w2, 1e-5)
        rh = F.rms_norm(x, 1e-8) * w + res
        assert _close(h, rh) and _close(x2, F.rms_norm(rh, 1e-5) * w2)
