"""The v3 device layout and its dequant-matvec (kernels/qmatvec_v3.py): the repack is a pure
reordering (pack then unpack gives the weights.repack fields back, byte for byte), the in-kernel
decoder is ggml's value bit for bit, and the matvec meets the reference within f32 reordering,
run by the Triton interpreter on tiny shapes (compiled on the GPU machine: tools/device_kernels.py)."""

from __future__ import annotations

import importlib

import numpy as np

import pytest
import torch

from muser.engine.weights import random_bytes, repack
from muser.gguf.types import GgmlType as G

FORMATS = (G.Q4_K, G.Q5_K, G.Q6_K, G.NVFP4_E2M1, G.NVFP4)


@pytest.fixture(scope="module")
def v3(kernels):
    """qmatvec_v3 re-imported while the `kernels` fixture holds TRITON_INTERPRET=1."""
    from muser.engine.kernels import qmatvec_v3

    return kernels[0], importlib.reload(qmatvec_v3)


def _w(fmt, n_out, n_in, seed=0):
    if fmt in (G.NVFP4_E2M1, G.NVFP4):
        from muser.engine import nvfp4

        raw, sc, s2 = nvfp4.random_bytes(fmt, n_out, n_in, seed)
        return repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()),
                      None if sc is None else torch.from_numpy(sc.copy()), s2)
    raw = random_bytes(fmt, n_out, n_in, seed)
    return repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_v3_pack_is_a_reordering(v3, fmt):
    _, m = v3
    w = _w(fmt, 6, 768, 4)
    p = m.pack(w, chunk_elems=1024)  # several row chunks
    assert p.nbytes <= w.nbytes + 4 * 6 * 768 // 256  # same bytes, scales regrouped
    back = m.unpack(p)
    assert set(back) == set(w.fields)
    for k, v in w.fields.items():
        assert torch.equal(back[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k
    assert torch.equal(m.decode(p).view(torch.int32), w.decode().view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_v3_decoder_bit_exact(v3, fmt):
    _, m = v3
    w = _w(fmt, 5, 768, 1)
    p = m.pack(w)
    ref = w.decode().view(torch.int32)
    for bn, j in ((4, 8), (2, 16), (8, 4)):  # partial row tile and partial unit chunk
        assert torch.equal(m.dequant_v3(p, bn=bn, j=j).view(torch.int32), ref), (bn, j)


def test_v3_decoder_every_scale_and_quant_value(v3):
    """Every 6-bit scale/min, every 4/5-bit quant, f16 d/dmin of both signs, subnormal, zero and
    extreme (the fma decode's exactness argument, checked rather than assumed); Q6_K every int8
    scale and 6-bit quant."""
    _, m = v3
    g = torch.Generator().manual_seed(3)
    d = torch.tensor([6.0e-8, -6.0e-8, 1e-4, -3.5, 65504.0, -65504.0, 0.0, -0.0], dtype=torch.float16)
    for fmt in (G.Q4_K, G.Q5_K, G.Q6_K):  # NVFP4: test_v3_decoder_every_nvfp4_code_and_scale_byte
        n_out, nb = 8, 8
        w = _w(fmt, n_out, nb * 256, 7)
        if fmt == G.Q6_K:
            w.fields["sc"] = (torch.arange(n_out * nb * 16) % 256 - 128).to(torch.int8).view(n_out, nb * 16)
            w.fields["d"] = d[torch.randint(0, 8, (n_out, nb), generator=g)]
        else:
            sc = torch.arange(n_out * nb * 8, dtype=torch.int64) % 64
            w.fields["sc"] = sc.to(torch.uint8).view(n_out, nb * 8)
            w.fields["m"] = sc.flip(0).to(torch.uint8).view(n_out, nb * 8)
            w.fields["d"] = d[torch.randint(0, 8, (n_out, nb), generator=g)]
            w.fields["dmin"] = d[torch.randint(0, 8, (n_out, nb), generator=g)]
        ref = w.decode().view(torch.int32)
        assert torch.equal(m.dequant_v3(m.pack(w)).view(torch.int32), ref), fmt.name


@pytest.mark.parametrize("fmt", (G.NVFP4_E2M1, G.NVFP4), ids=lambda f: f.name)
def test_v3_decoder_every_nvfp4_code_and_scale_byte(v3, fmt):
    """Every E2M1 code against every scale byte (E4M3FN of both signs, zero and subnormal; UE4M3
    with its ignored bit 7), both scale slots of a unit, and a negative scale2: the decoded weight
    is the reference decoder's bit for bit, the sign of every zero included."""
    _, m = v3
    n_in = 256 * 16  # 16 codes x 256 bytes, one (code, byte) pair per element
    w = _w(fmt, 2, n_in, 5)
    code = torch.arange(n_in) % 16
    byte = (torch.arange(n_in) // 16) % 256
    if fmt == G.NVFP4_E2M1:
        byte = torch.where((byte & 0x7F) == 0x7F, byte - 1, byte)  # NaN bytes are refused at load
        w.fields["qs"] = (code[0::2] | (code[1::2] << 4)).to(torch.uint8).repeat(2, 1)
        w.fields["sc"] = byte[0::16].to(torch.uint8).repeat(2, 1)
        w.fields["s2"] = torch.tensor([3.0e-3, -7.5e-4], dtype=torch.float32)
    else:  # per 16: low nibble element j, high nibble element j + 8
        c = code.view(-1, 2, 8)
        w.fields["qs"] = (c[:, 0] | (c[:, 1] << 4)).reshape(-1).to(torch.uint8).repeat(2, 1)
        w.fields["d"] = byte[0::16].to(torch.uint8).repeat(2, 1)
    assert code.view(-1, 16)[:, 8].eq(8).all()  # code 8 (the signed zero) in every block
    ref = w.decode().view(torch.int32)
    p = m.pack(w)
    assert torch.equal(m.decode(p).view(torch.int32), ref)
    assert torch.equal(m.dequant_v3(p).view(torch.int32), ref)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("T", [1, 3, 16])
def test_v3_matvec_vs_reference(v3, fmt, T):
    qmv, m = v3
    w = _w(fmt, 10, 768, 2)
    p = m.pack(w)
    x = torch.randn(T, 768, generator=torch.Generator().manual_seed(T))
    ref = qmv.matvec_ref(w, x)
    scale = x.abs() @ w.decode().abs().T
    for cfg in (None, (4, 4, True), (8, 4, False), (32, 4, True), (8, 2, True)):
        if cfg is not None and T > 1:  # register prefetch is the one-row loop's
            cfg = (cfg[0], cfg[1], 0)
        got = m.matvec_v3(p, x, config=cfg)
        assert torch.all((got - ref).abs() <= 1e-6 * scale + 1e-30), cfg


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_v3_rows_are_bitwise_invariant(v3, fmt):
    """A row's outputs are the same bits alone, inside any row bucket (2..16) and under every
    tiling config: decode, verify and batched decode agree exactly (row invariance)."""
    _, m = v3
    w = _w(fmt, 12, 1280, 4)  # 40 units: a partial second 32-unit chunk
    p = m.pack(w)
    x = torch.randn(16, 1280, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([m.matvec_v3(p, x[i:i + 1]) for i in range(16)])
    for T in (2, 3, 7, 16):
        for cfg in (None, (4, 4, 0), (2, 2, False), (4, 4, 3)):
            got = m.matvec_v3(p, x[:T], config=cfg)
            assert torch.equal(got.view(torch.int32), alone[:T].view(torch.int32)), (T, cfg)
        if T in (3, 7):  # rows a program takes: a partial last group reads the call's last row
            for rt in (2, 4):
                got = m.matvec_v3(p, x[:T], config=(4, 2, 0), rt=rt)
                assert torch.equal(got.view(torch.int32), alone[:T].view(torch.int32)), (T, rt)
    for cfg in ((4, 4, True), (16, 4, False), (8, 2, True), (8, 4, 2), (4, 2, 4)):
        assert torch.equal(m.matvec_v3(p, x[5:6], config=cfg).view(torch.int32), alone[5:6].view(torch.int32))


def test_v3_act_prep_layout_and_unit_sums(v3):
    """The several-row path's activations: element (unit u, nibble e, lane w) of a row at
    ((u // 32) * 8 + e) * 128 + 4 (u % 32) + w, times 2^(64 - P(e)) (P = 4e, 4e - 12 above nibble
    4: the one-row path's factor), the row padded with zeros to whole 32-unit chunks; the unit
    sums are the one-row path's f32 sums in nibble order (all 8 nibbles; nibbles 0-3 and 4-7),
    bit for bit; SCALE off leaves the values as they are."""
    _, m = v3
    T, K = 3, 1280  # 40 units: a partial second chunk, 24 padding units
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 3, K)
    xq, xs = m.act_prep(x)
    xp, none = m.act_prep(x, scale=False)
    assert xq.shape == (T, 64 * 32) and xs.shape == (T, 3, 64, 4) and none is None
    u, e, w = torch.meshgrid(torch.arange(40), torch.arange(8), torch.arange(4), indexing="ij")
    dst = (((u // 32) * 8 + e) * 128 + (u % 32) * 4 + w).reshape(-1)
    src = (u * 32 + 4 * e + w).reshape(-1)
    P = torch.where(e <= 4, 4 * e, 4 * e - 12).reshape(-1)
    want = x[:, src] * torch.pow(2.0, (64 - P).to(torch.float64)).to(torch.float32)
    assert torch.equal(xq[:, dst].view(torch.int32), want.view(torch.int32))
    assert torch.equal(xp[:, dst].view(torch.int32), x[:, src].view(torch.int32))
    pad = torch.ones(64 * 32, dtype=torch.bool)
    pad[dst] = False
    assert torch.equal(xq[:, pad], torch.zeros_like(xq[:, pad])) and not xs[:, :, 40:].any()
    xv = x.view(T, 40, 8, 4)  # [row, unit, nibble, lane]
    full, lo, hi = xv[:, :, 0].clone(), xv[:, :, 0].clone(), xv[:, :, 4].clone()
    for k in range(1, 8):
        full = full + xv[:, :, k]  # f32, nibble order
    for k in range(1, 4):
        lo, hi = lo + xv[:, :, k], hi + xv[:, :, 4 + k]
    for plane, ref in enumerate((full, lo, hi)):
        assert torch.equal(xs[:, plane, :40].view(torch.int32), ref.view(torch.int32)), plane


def test_v3_refuses(v3):
    _, m = v3
    with pytest.raises(ValueError):
        m.pack(_w(G.Q8_0, 4, 64))
    p = m.pack(_w(G.Q4_K, 4, 256))
    with pytest.raises(AssertionError):
        m.matvec_v3(p, torch.zeros(17, 256))
    with pytest.raises(AssertionError):
        m.matvec_v3(p, torch.zeros(1, 512))
    for cfg in ((4, 4, 5), (4, 4, -1), (6, 2, 0), (2, 4, 0)):  # pipeline depth, powers of two, BN % warps
        for T in (1, 4):
            with pytest.raises(ValueError, match="config"):
                m.matvec_v3(p, torch.zeros(T, 256), config=cfg)
    with pytest.raises(ValueError, match="config"):  # register prefetch: the one-row loop's only
        m.matvec_v3(p, torch.zeros(4, 256), config=(4, 4, 1))
    for T, rt in ((1, 2), (2, 1), (4, 3), (16, 8)):  # rows a program takes: 1 for one row, else 2 or 4
        with pytest.raises(ValueError, match="rows per program"):
            m.matvec_v3(p, torch.zeros(T, 256), rt=rt)


def test_v3_stack_members_are_views_and_outputs_match(v3):
    """Stacked q|k|gate-style projections: one launch gives each member's own result, the
    members' packed layouts become row views of the stack, and a format mismatch is refused."""
    _, m = v3
    ws = [_w(G.Q4_K, n, 512, 10 + i) for i, n in enumerate((8, 4, 8))]
    for w in ws:
        w.packed = m.pack(w)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(5))
    alone = [m.matvec_v3(w.packed, x) for w in ws]
    st = m.stack(ws)
    assert st.packed.n_out == 20 and st.bounds == ((0, 8), (8, 12), (12, 20))
    for w, (a, b) in zip(ws, st.bounds):
        assert w.packed.fields["q"].data_ptr() == st.packed.fields["q"][a:b].data_ptr()
        assert torch.equal(m.decode(w.packed).view(torch.int32), w.decode().view(torch.int32))
    got = st.split(m.matvec_v3(st.packed, x))
    scale = [x.abs() @ w.decode().abs().T for w in ws]
    for g, r, s in zip(got, alone, scale):
        assert torch.all((g - r).abs() <= 1e-6 * s + 1e-30)
    q6 = _w(G.Q6_K, 4, 512, 3)
    q6.packed = m.pack(q6)
    assert m.stack([ws[0], q6]) is None
    assert m.stack([ws[0], _w(G.Q4_K, 4, 512)]) is None  # not packed


def test_v3_tuning_file(v3, tmp_path):
    import json

    _, m = v3
    p = m.pack(_w(G.Q4_K, 8, 512))
    f = tmp_path / "t.json"
    f.write_text(json.dumps([{"fmt": "Q4_K", "rows": 1, "n_out": 8, "n_in": 512, "config": [8, 4, False]}]))
    saved = dict(m.TUNED)
    try:
        assert m.load_tuning(str(f)) == 1
        assert m.config_for(p, 1) == (8, 4, False, 0)
        bn, nw, pipe = m.CONFIGS[16]
        assert m.config_for(p, 16) == (nw, nw, pipe, 0)  # 8 outputs: one weight row a thread
        # several rows: the table may name the rows a program takes (RT); the 16-row entry serves 2..16
        f.write_text(json.dumps([{"fmt": "Q4_K", "rows": 16, "n_out": 8, "n_in": 512, "config": [8, 4, 0, 4]}]))
        assert m.load_tuning(str(f)) == 1
        assert m.config_for(p, 4) == (8, 4, 0, 4)
        from muser.errors import LaneError

        before = dict(m.TUNED)
        for bad in ([{"fmt": "Q4_K", "rows": 1, "n_out": 8, "n_in": 512, "config": [6, 4, False]}],
                    [{"fmt": "Q4_K", "rows": 1, "n_out": 8, "n_in": 512, "config": [8, 4, False]},
                     {"fmt": "Q4_K", "rows": 3, "n_out": 8, "n_in": 512, "config": [8, 4, False]}],
                    [{"fmt": "Q4_K", "rows": 1, "n_out": 8, "n_in": 512, "config": [8, 32, 4, False]}],
                    [{"fmt": "Q4_K", "rows": 1, "n_out": 8, "n_in": 512, "config": [8, 4, 0, 2]}],  # RT: several rows
                    [{"fmt": "Q4_K", "rows": 16, "n_out": 8, "n_in": 512, "config": [8, 4, 0, 3]}],
                    [{"fmt": "Q4_K", "rows": 16, "n_out": 8, "n_in": 512, "config": [8, 4, 0, 2, 1]}],
                    [{"fmt": "Q4_K", "rows": 1}]):
            f.write_text(json.dumps(bad))
            with pytest.raises(LaneError, match="t.json"):
                m.load_tuning(str(f))
            assert m.TUNED == before  # nothing half-taken
        f.write_text("{not json")
        with pytest.raises(LaneError):
            m.load_tuning(str(f))
    finally:
        m.TUNED.clear()
        m.TUNED.update(saved)


def test_v3_tuning_file_refuses_an_entry_for_another_path(v3, tmp_path, monkeypatch):
    """The table tunes the matvec only: an entry whose "path" names anything else ("gemm", or a
    typo) refuses the whole file, naming the value; "path": "matvec" is the default spelled out."""
    import json

    from muser.errors import LaneError

    _, m = v3
    monkeypatch.setattr(m, "TUNED", dict(m.TUNED))
    f = tmp_path / "t.json"
    good = {"fmt": "Q4_K", "rows": 1, "n_out": 8, "n_in": 512, "config": [8, 4, 0]}
    f.write_text(json.dumps([good | {"path": "matvec"}]))
    assert m.load_tuning(str(f)) == 1 and m.TUNED[("Q4_K", 1, 8, 512)] == (8, 4, 0, 0)
    before = dict(m.TUNED)
    for route in ("gemm", "tiles", None):
        e = {"fmt": "Q4_K", "rows": 16, "n_out": 8, "n_in": 512, "config": [8, 8, 1], "path": route}
        f.write_text(json.dumps([good | {"n_out": 16}, e]))
        with pytest.raises(LaneError, match=f"t.json.*path {route!r}"):
            m.load_tuning(str(f))
        assert m.TUNED == before  # nothing half-taken


def test_v3_forward_with_packed_stacks_matches_reference(v3, make_gguf, monkeypatch):
    """The CUDA forward's decode path on the CPU under the interpreter: K-quant matrices packed
    (fields dropped, as on the GPU), q|k|v|gate and gate|up stacked, decode-shaped steps through
    the v3 kernel, the fused element-wise tails (kernels/fused.py) in place of the torch chains;
    logits meet the reference forward's within f32 reordering through a prefill past 48 rows (16-row
    matvec slices over the packed layout), and a chunk's last row is bitwise the same tokens'
    through a shorter slice and one-row decodes."""
    import importlib

    from muser.engine.kernels import fused

    importlib.reload(fused)  # interpreted, like the kernels fixture's modules
    from muser.engine import Engine
    from muser.model.synth import SynthSpec

    _, m = v3
    # big tiles: few programs, so the interpreter's per-program cost stays small (its work is per
    # program, not per weight row; the bits do not depend on the tiling)
    monkeypatch.setattr(m, "config_for", lambda p, rows: (512, 4, False, 0))
    path = make_gguf(SynthSpec(dtype="q4_k_xl", source="blocks"))
    ref = Engine.open(path, device="cpu", lane="exact", kv="f32")
    eng = Engine.open(path, device="cpu", lane="exact", kv="f32")
    eng.weights.pack_for_decode(drop_fields=True)
    assert all(L.ffn_in is not None and L.attn_in is not None for L in eng.weights.layers)
    assert all(not w.fields for w in eng.weights.matrices() if w is not eng.weights.embd and w.packed is not None)
    eng.forward.linear.triton_rows = True  # the CUDA path: fused kernels for <= 16 rows
    from muser.engine.kernels import fused

    eng.forward.native, eng.forward.tails = False, fused  # the CUDA forward's Triton tails
    prompt = [6 + (i * 37) % 300 for i in range(50)]
    rs, es = ref.session(max_context=128, graphs=False), eng.session(max_context=128, graphs=False)
    a = [rs.prefill(prompt)]
    b = [es.prefill(prompt)]  # 50 rows: three 16-row slices and a 2-row one
    for t in (7, 11):
        a.append(rs.decode(t))
        b.append(es.decode(t))  # one row: stacked v3 launches
    a.append(rs.verify([5, 9, 17])[-1])
    b.append(es.verify([5, 9, 17])[-1])  # 3 rows: the several-row v3 path
    for x, y in zip(a, b):
        assert np.max(np.abs(x - y)) <= 2e-4 * max(1.0, float(np.max(np.abs(x))))
    # row invariance through the CUDA dispatch (short chunks keep the interpreter's work small):
    # 6 tokens as one 6-row slice, and as a 4-row slice and two one-row decodes, give the last
    # position the same bits (every K/V row on the way too)
    g = eng.session(max_context=16, graphs=False).prefill(prompt[:6])
    s2 = eng.session(max_context=16, graphs=False)
    s2.prefill(prompt[:4])
    s2.decode(prompt[4])
    last = s2.decode(prompt[5])
    assert np.array_equal(np.asarray(last).view(np.int32), np.asarray(g).view(np.int32))


@pytest.mark.parametrize("fmt", (G.Q4_K, G.NVFP4), ids=lambda f: f.name)
def test_exact_lane_slices_keep_each_rows_bits(v3, fmt):
    """The exact lane's CUDA projection (Linear with the Triton kernels) at every row count: slices
    of <= 16 rows, past 16 and past 48 rows; every row has the bits of the same row projected
    alone, for a matrix and for a stack, and meets the reference within f32 reordering."""
    from muser.engine.lanes import Lane, Linear

    qmv, m = v3
    ws = [_w(fmt, 8, 512, s) for s in (1, 2)]
    for w in ws:
        w.packed = m.pack(w)
    st = m.stack(ws)
    lin = Linear(Lane.EXACT, torch.device("cpu"))
    lin.triton_rows = True  # the CUDA dispatch (the interpreter runs the kernels)
    wide_rows = 49  # three full slices and a one-row slice
    x = torch.randn(wide_rows, 512, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([lin(ws[0], x[i:i + 1]) for i in range(19)])
    for T in (17, 19):
        assert torch.equal(lin(ws[0], x[:T]).view(torch.int32), alone[:T].view(torch.int32)), T
    assert lin.stacked_ok(16, st) and lin.stacked_ok(wide_rows, st)
    both = lin.stacked_raw(st, x[:19])  # [19, 16]: member 0's columns first
    assert torch.equal(both[:, :8].view(torch.int32), alone.view(torch.int32))
    ref = qmv.matvec_ref(ws[0], x)
    wide = lin(ws[0], x)  # past 48 rows
    scale = x.abs() @ ws[0].decode().abs().T
    assert torch.all((wide - ref).abs() <= 1e-6 * scale + 1e-30)
    assert torch.equal(wide[:19].view(torch.int32), alone.view(torch.int32))
    assert torch.equal(wide[48:].view(torch.int32), lin(ws[0], x[48:]).view(torch.int32))
    both = lin.stacked_raw(st, x)  # the stack past 48 rows: slices over both members
    assert torch.equal(both[:, :8].view(torch.int32), wide.view(torch.int32))


def _run_fp4_ptx(text: str, words: np.ndarray) -> list[np.ndarray]:
    """Executes the NVFP4 decoder's PTX (the few opcodes it uses, by the PTX ISA's definitions)
    over uint32 words; returns the eight f32 outputs $0..$7."""
    reg: dict[str, np.ndarray] = {"$8": words.astype(np.uint32)}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        return reg[tok] if tok in reg else np.full(words.shape, int(tok, 0), dtype=np.uint32)

    def prmt(a, b, c):
        src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)  # bytes 0..7 = a, then b
        out = np.zeros(words.shape, dtype=np.uint32)
        for i in range(4):
            sel = (c >> np.uint32(4 * i)) & np.uint32(0xF)
            byte = ((src >> ((sel & np.uint32(7)).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(np.uint32)
            byte = np.where(sel & np.uint32(8), np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0)), byte)
            out |= byte << np.uint32(8 * i)
        return out

    for line in text.split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):
            halves, src = rest.split("}")
            lo, hi = (h.strip() for h in halves.strip("{ ").split(","))
            p = val(src.strip(", "))
            reg[lo], reg[hi] = p & np.uint32(0xFFFF), p >> np.uint32(16)
            continue
        d, *args = (t.strip() for t in rest.split(","))
        x = [val(t) for t in args]
        if op == "mov.b32":
            reg[d] = x[0]
        elif op == "and.b32":
            reg[d] = x[0] & x[1]
        elif op == "or.b32":
            reg[d] = x[0] | x[1]
        elif op == "shr.u32":
            reg[d] = x[0] >> x[1]
        elif op == "shl.b32":
            reg[d] = x[0] << x[1]
        elif op == "prmt.b32":
            reg[d] = prmt(*x)
        elif op == "cvt.f32.f16":
            reg[d] = x[0].astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
        else:
            raise AssertionError(f"opcode {op} not emulated")
    return [reg[f"${i}"].view(np.float32) for i in range(8)]


@pytest.mark.parametrize("fmt", (G.NVFP4_E2M1, G.NVFP4), ids=lambda f: f.name)
def test_v3_nvfp4_permute_decoder_gives_every_code_its_value(v3, fmt):
    """The compiled kernels' byte-permute decoder (PTX text, run by an emulator of its opcodes) and
    the plain integer decoder the interpreter runs give every code at every word position ggml's
    kvalues_fp4 value with the code's sign (code 8: -0.0), bit for bit."""
    _, m = v3
    if not m.HAVE_TRITON:
        pytest.skip("triton is not installed")
    n_in = 32 * 16 * 4  # every code at every (e, w) slot of a unit, with mixed neighbours
    w = _w(fmt, 3, n_in, 9)
    code = (torch.arange(n_in) + torch.arange(n_in) // 512) % 16
    if fmt == G.NVFP4_E2M1:
        w.fields["qs"] = (code[0::2] | (code[1::2] << 4)).to(torch.uint8).repeat(3, 1)
    else:
        c = code.view(-1, 2, 8)
        w.fields["qs"] = (c[:, 0] | (c[:, 1] << 4)).reshape(-1).to(torch.uint8).repeat(3, 1)
    p = m.pack(w)
    words = p.fields["q"].view(3, n_in // 32, 4).numpy().view(np.uint32)  # [r, unit, w]
    mag = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float32)
    codes = code.view(n_in // 32, 8, 4).numpy()  # [unit, e, w]: element 4e + w
    want = np.where(codes >= 8, -mag[codes & 7], mag[codes & 7]).astype(np.float32)
    got = _run_fp4_ptx(m._FP4_PTX.value, words)
    for e in range(8):
        assert np.array_equal(got[e][0].view(np.uint32), want[:, e].view(np.uint32)), e
    assert torch.equal(m.unpack(p)["qs"], w.fields["qs"])
