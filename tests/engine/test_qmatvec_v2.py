"""The streamed dequant-matvec (kernels/qmatvec_v2.py) against the torch decoder and the
reference matvec, run by the Triton interpreter on tiny shapes (compiled on the GPU machine:
tools/device_kernels.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from muser.engine.weights import random_bytes, repack
from muser.gguf.types import GgmlType as G

FORMATS = (G.F16, G.Q8_0, G.Q4_K, G.Q5_K, G.Q6_K)


@pytest.fixture(scope="module")
def v2(kernels):
    """qmatvec_v2 re-imported while the `kernels` fixture holds TRITON_INTERPRET=1."""
    from muser.engine.kernels import qmatvec_v2

    return kernels[0], importlib.reload(qmatvec_v2)


def _w(fmt, n_out, n_in, seed=0):
    raw = random_bytes(fmt, n_out, n_in, seed)
    return repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


def _n_in(fmt):
    return 288 if fmt in (G.F16, G.Q8_0) else 512  # partial last chunk for the 32-element blocks


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_v2_tile_decoder_bit_exact(v2, fmt):
    _, m = v2
    w = _w(fmt, 5, _n_in(fmt), 1)
    ref = w.decode().view(torch.int32)
    for block_n, sb, fma_decode in ((2, 1, False), (4, 2, False), (2, 1, True)):
        got = m.dequant_v2(w, block_n=block_n, sb=sb, fma_decode=fma_decode)
        assert torch.equal(got.view(torch.int32), ref), (block_n, sb, fma_decode)


def test_v2_decoder_every_scale_and_quant_value(v2):
    """Q4_K/Q5_K fma decode = two-rounding decode on every 6-bit scale/min and 5-bit quant,
    with f16 d/dmin of both signs, subnormal, tiny and huge (the exactness argument of the
    module doc, checked rather than assumed)."""
    _, m = v2
    for fmt in (G.Q4_K, G.Q5_K):
        n_out, nb = 8, 8
        w = _w(fmt, n_out, nb * 256, 7)
        g = torch.Generator().manual_seed(3)
        sc = torch.arange(n_out * nb * 8, dtype=torch.int64) % 64
        w.fields["sc"] = sc.to(torch.uint8).view(n_out, nb * 8)
        w.fields["m"] = sc.flip(0).to(torch.uint8).view(n_out, nb * 8)
        d = torch.tensor([6.0e-8, -6.0e-8, 1e-4, -3.5, 65504.0, -65504.0, 0.0, 1.0], dtype=torch.float16)
        w.fields["d"] = d[torch.randint(0, 8, (n_out, nb), generator=g)]
        w.fields["dmin"] = d[torch.randint(0, 8, (n_out, nb), generator=g)]
        ref = w.decode().view(torch.int32)
        assert torch.equal(m.dequant_v2(w, fma_decode=True).view(torch.int32), ref)
        assert torch.equal(m.dequant_v2(w, fma_decode=False).view(torch.int32), ref)


def _close(got, w, x):
    # f32 accumulation in another order: bound by the float64 dot, relative to the sum of |products|
    dq = w.decode().double()
    exact = x.double() @ dq.T
    scale = x.abs().double() @ dq.abs().T
    return float(((got.double() - exact).abs() / (scale + 1e-300)).max())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("T", [1, 2, 5, 16])
def test_v2_matvec_vs_reference(v2, fmt, T):
    v1, m = v2
    w = _w(fmt, 19, _n_in(fmt), 2)  # 19 rows: not a multiple of any BLOCK_N
    x = torch.randn(T, w.n_in, generator=torch.Generator().manual_seed(T))
    got = m.matvec_v2(w, x)
    ref = v1.matvec_ref(w, x)
    assert got.shape == ref.shape == (T, 19)
    assert _close(got, w, x) < 1e-6
    assert _close(ref, w, x) < 1e-6
    assert (got - v1.matvec_triton(w, x)).abs().max().item() <= 2e-6 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("config", [(2, 1, 4, False), (4, 2, 4, False), (2, 1, 4, True), (8, 2, 8, True)])
def test_v2_every_config_shape(v2, config):
    """The device sweep's tile shapes (both accumulators) give the same answer; an odd row
    count and a K that is not a multiple of the chunk (3 super-blocks, SB = 2)."""
    _, m = v2
    for fmt in (G.Q4_K, G.Q6_K):
        w = _w(fmt, 11, 768, 4)
        for T in (1, 3):
            x = torch.randn(T, 768, generator=torch.Generator().manual_seed(5))
            assert _close(m.matvec_v2(w, x, config=config), w, x) < 1e-6
            assert _close(m.matvec_v2(w, x, config=config, fma_decode=True), w, x) < 1e-6


def test_v2_out_and_strided_rows(v2):
    _, m = v2
    w = _w(G.Q4_K, 9, 512, 8)
    xb = torch.randn(3, 600, generator=torch.Generator().manual_seed(1))
    x = xb[:, :512]  # row stride 600
    out = torch.full((3, 9), float("nan"))
    y = m.matvec_v2(w, x, out=out)
    assert y is out and _close(y, w, x) < 1e-6


def test_v2_refuses(v2):
    _, m = v2
    w = _w(G.Q4_K, 4, 256)
    with pytest.raises(AssertionError):
        m.matvec_v2(w, torch.zeros(17, 256))
    with pytest.raises(AssertionError):
        m.matvec_v2(w, torch.zeros(1, 512))
    with pytest.raises(ValueError):
        m.matvec_v2(_w(G.Q4_0, 4, 256), torch.zeros(1, 256))


def test_kernel_dispatch(v2, monkeypatch):
    """qmatvec.matvec (the engine's call): the v3 kernel for a weight carrying the packed layout,
    else v2 for a v2 format, else v1; MUSER_MATVEC=v1|v2 forces an older kernel, an unknown value
    and an older kernel on a packed-only weight are refused; matvec_triton is always v1."""
    v1, m = v2
    import muser.engine.kernels as pkg
    from muser.engine.kernels import qmatvec_v3 as m3
    from muser.errors import LaneError

    calls = []
    real = m.matvec_v2

    def spy(w, x, out=None):
        calls.append(("v2", w.fmt))
        return real(w, x, out)

    def spy3(p, x, out=None):
        calls.append(("v3", p.fmt))
        return torch.zeros(x.shape[0], p.n_out)

    monkeypatch.setattr(pkg, "qmatvec_v2", m, raising=False)
    monkeypatch.setattr(m, "matvec_v2", spy)
    monkeypatch.setattr(m3, "matvec_v3", spy3)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    wq, w0 = _w(G.Q4_K, 5, 256), _w(G.Q4_0, 5, 256)
    monkeypatch.delenv("MUSER_MATVEC", raising=False)
    v1.matvec_triton(wq, x)
    assert calls == []
    y = v1.matvec(wq, x)  # not packed: v2
    assert calls == [("v2", G.Q4_K)] and _close(y, wq, x) < 1e-6
    v1.matvec(w0, x)  # Q4_0: no v2 kernel, the v1 kernel serves it
    assert calls == [("v2", G.Q4_K)]
    wq.packed = m3.pack(wq)
    v1.matvec(wq, x)
    assert calls[-1] == ("v3", G.Q4_K)
    monkeypatch.setenv("MUSER_MATVEC", "v2")
    v1.matvec(wq, x)
    assert calls[-1] == ("v2", G.Q4_K)
    monkeypatch.setenv("MUSER_MATVEC", "v9")
    with pytest.raises(LaneError, match="v9"):
        v1.matvec(wq, x)
    monkeypatch.setenv("MUSER_MATVEC", "v1")
    wq.fields = {}
    with pytest.raises(LaneError, match="only the v3 layout"):
        v1.matvec(wq, x)


def test_device_kernels_script_smoke(v2, tmp_path):
    """tools/device_kernels.py end to end on tiny shapes (interpreter): every format checked
    (v2/v3 decoders bit-exact, v1/v2/v3 vs float64), timed, swept, JSON and v3 tuning written."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "device_kernels.py"
    spec = importlib.util.spec_from_file_location("device_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--out", str(tmp_path), "--device", "cpu", "--smoke", "--budget", "300", "--v2-sweep"])
    saved = json.loads((tmp_path / "device_kernels.json").read_text())
    assert saved["table"] == res["table"]
    ran = [c for c in saved["cases"] if "check" in c or "error" in c]
    assert sorted(c["fmt"] for c in ran) == ["F16", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    for c in ran:
        assert "error" not in c, c.get("traceback")
        assert c["check"]["ok"] and c["check"]["v2_decode_bitexact"], c
        for k in ("v1_T1", "v2_T1", "v1_T16", "v2_T16"):
            assert c[k]["mean_s"] > 0 and c[k]["GBps"] > 0
        if c["fmt"] in ("Q4_K", "Q5_K", "Q6_K"):
            assert c["check"]["v3_decode_bitexact"] and c["check"]["T1"]["v3"] < 1e-5
            assert c["v3_T1"]["mean_s"] > 0 and c["v3_T16"]["mean_s"] > 0
    assert saved["sweep"] and all("us" in s for s in saved["sweep"])
    assert saved["v3_sweep"] and all("us" in s for s in saved["v3_sweep"])
    receipt = json.loads(Path(res["receipt"]).read_text())
    assert receipt["kind"] == "kernels-cpu" and receipt["gate"]["status"] == "n/a" and receipt["git_sha"]
    tuning = json.loads((tmp_path / "v3_tuning.json").read_text())
    assert {t["fmt"] for t in tuning} == {"Q4_K", "Q5_K", "Q6_K"}
    assert saved["copy"]["GBps_read_plus_write"] > 0
    assert saved["per_token"]["v2_T1"]["matvec_s_per_step"] > 0
