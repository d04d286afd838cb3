"""Weights on the device, kept quantized: a load-time repack of each GGUF tensor into a
structure-of-arrays layout the kernels read directly, and the torch reference decoder.

The repack only moves bytes (the 6-bit K-quant scale/min packing of book 6.2 is unpacked to one
byte each; f16 block scales stay f16), so decoding the repacked form reproduces ggml's
`dequantize_row_*` bit for bit: every product is formed in f32 in ggml's order, one rounding
per operation, no fused multiply-add (ggml-quants.c dequantize_row_q4_K: `d1 = d * sc;
y = d1 * q - m1`). Tests compare `decode` against the reference codec on every format.

Per-element index maps (which byte, which shift, which sub-block scale) for a 256-element tile
are written once here; the Triton tile decoder (kernels/qmatvec.py) evaluates the same formulas
in-kernel, and a test holds the two decoders bit-identical.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from ..errors import LaneError
from ..gguf.types import GgmlType as G
from . import nvfp4 as _nv

QK = 256  # the tile every format is decoded in: one K-quant super-block, or 8 blocks of 32

# Formats the engine decodes exactly on the device; anything else is refused (LaneError).
# BASE_FORMATS are read by kernels/qgemm.py and kernels/qmatvec.py from their own bytes; NVFP4 (engine/nvfp4.py,
# kernels/nvfp4.py) adds the companion form and ggml's type 40.
BASE_FORMATS = (G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K)
DEVICE_FORMATS = (*BASE_FORMATS, *_nv.NVFP4_FORMATS)

# Numeric codes shared with the Triton kernels (kernels/qmatvec.py FMT constexpr).
FMT_CODE = {G.F32: 0, G.F16: 1, G.BF16: 2, G.Q8_0: 3, G.Q4_0: 4, G.Q4_K: 5, G.Q5_K: 6, G.Q6_K: 7,
            G.NVFP4_E2M1: 8, G.NVFP4: 9}  # NVFP4 codes: kernels/nvfp4.py

# Field names per format, in the order the kernels take them as pointers p0..p5.
FIELDS: dict[G, tuple[str, ...]] = {
    G.F32: ("w",),
    G.F16: ("w",),
    G.BF16: ("w",),
    G.Q8_0: ("qs", "d"),
    G.Q4_0: ("qs", "d"),
    G.Q4_K: ("qs", "d", "dmin", "sc", "m"),
    G.Q5_K: ("qs", "d", "dmin", "sc", "m", "qh"),
    G.Q6_K: ("ql", "qh", "sc", "d"),
    **_nv.FIELDS,
}

# Elements per block of each format (the row length must be a multiple of it).
BLOCK = {G.F32: 1, G.F16: 1, G.BF16: 1, G.Q8_0: 32, G.Q4_0: 32, G.Q4_K: 256, G.Q5_K: 256, G.Q6_K: 256,
         **_nv.BLOCK}


# ---------------------------------------------------------------------------------------------
# index maps: element e of a 256-wide tile -> (byte, shift, scale slot)


@lru_cache(maxsize=None)
def index_maps(fmt: G) -> dict[str, np.ndarray]:
    """Per-element tables for one 256-element tile (see module doc). numpy int64 [256]."""
    e = np.arange(QK, dtype=np.int64)
    if fmt in (G.Q4_K, G.Q5_K):
        # ggml dequantize_row_q4_K/q5_K: 64-element groups g; first 32 take the low nibble of
        # qs[32g + l], the next 32 the high nibble; sub-block (scale) j = e // 32.
        g, half, l = e // 64, (e // 32) % 2, e % 32
        return {"qs_idx": g * 32 + l, "qs_shift": 4 * half, "sub": e // 32,
                "qh_idx": l, "qh_bit": 2 * g + half}
    if fmt == G.Q6_K:
        # ggml dequantize_row_q6_K: two 128-halves n; quarter q of each takes ql[l (+32)] low/high
        # nibble and 2 bits of qh[l] at 2q; scale sc[8n + l/16 + 2q].
        n, r = e // 128, e % 128
        quarter, l = r // 32, r % 32
        return {"ql_idx": n * 64 + l + 32 * (quarter % 2), "ql_shift": 4 * (quarter // 2),
                "qh_idx": n * 32 + l, "qh_shift": 2 * quarter, "sub": n * 8 + l // 16 + 2 * quarter}
    return {}


@lru_cache(maxsize=None)
def _maps_on(fmt: G, device: str) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device) for k, v in index_maps(fmt).items()}


# ---------------------------------------------------------------------------------------------
# the weight


@dataclass
class QWeight:
    """One 2-D weight [n_out, n_in] (numpy order) on a device, in its repacked form."""

    name: str
    fmt: G
    n_out: int
    n_in: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(iter(self.fields.values())).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    @property
    def n_tiles(self) -> int:  # 256-wide tiles per row (last one may be partial for 32-blocks)
        return -(-self.n_in // QK)

    def pointers(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.fields[k] for k in FIELDS[self.fmt])

    def decode(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """f32 [r, n_in]: rows `rows` (int64 device tensor) or all rows. Bit-exact ggml."""
        if rows is None:
            f = self.fields
        else:
            f = {k: v.index_select(0, rows) for k, v in self.fields.items()}
        return decode_fields(self.fmt, f, self.n_in)


def decode_fields(fmt: G, f: dict[str, torch.Tensor], n_in: int) -> torch.Tensor:
    """The torch reference decoder of the repacked layout: f32 [r, n_in]."""
    if fmt in (G.F32, G.F16, G.BF16):
        return f["w"].to(torch.float32)  # f16/bf16 -> f32 is exact
    if fmt in _nv.NVFP4_FORMATS:
        return _nv.decode_fields(fmt, f, n_in)
    dev = str(next(iter(f.values())).device)
    mp = _maps_on(fmt, dev)
    if fmt == G.Q8_0:
        r = f["qs"].shape[0]
        q = f["qs"].to(torch.float32).view(r, -1, 32)
        d = f["d"].to(torch.float32).view(r, -1, 1)
        return (q * d).view(r, n_in)  # ggml: y = qs[j] * d
    if fmt == G.Q4_0:
        r = f["qs"].shape[0]
        nblk = n_in // 32
        qs = f["qs"].view(r, nblk, 16)
        j = torch.arange(32, device=qs.device)
        b = qs[:, :, j % 16]  # [r, nblk, 32]
        q = ((b >> (4 * (j // 16)).to(torch.uint8)) & 0xF).to(torch.int32) - 8
        d = f["d"].to(torch.float32).view(r, nblk, 1)
        return (q.to(torch.float32) * d).view(r, n_in)  # ggml: y = (q - 8) * d
    nb = n_in // QK
    r = f["d"].shape[0]
    if fmt in (G.Q4_K, G.Q5_K):
        qs = f["qs"].view(r, nb, 128)[:, :, mp["qs_idx"]]  # [r, nb, 256]
        q = (qs >> mp["qs_shift"].to(torch.uint8)) & 0xF
        if fmt == G.Q5_K:
            qh = f["qh"].view(r, nb, 32)[:, :, mp["qh_idx"]]
            q = q + (((qh >> mp["qh_bit"].to(torch.uint8)) & 1) << 4)  # ggml: + (qh & u ? 16 : 0)
        sc = f["sc"].view(r, nb, 8)[:, :, mp["sub"]].to(torch.float32)
        m = f["m"].view(r, nb, 8)[:, :, mp["sub"]].to(torch.float32)
        d = f["d"].to(torch.float32).view(r, nb, 1)
        dmin = f["dmin"].to(torch.float32).view(r, nb, 1)
        d1 = d * sc  # ggml: const float d1 = d * sc
        m1 = dmin * m  # ggml: const float m1 = min * m
        return (d1 * q.to(torch.float32) - m1).view(r, n_in)  # two roundings, never an FMA
    if fmt == G.Q6_K:
        ql = f["ql"].view(r, nb, 128)[:, :, mp["ql_idx"]]
        qh = f["qh"].view(r, nb, 64)[:, :, mp["qh_idx"]]
        lo = (ql >> mp["ql_shift"].to(torch.uint8)) & 0xF
        hi = (qh >> mp["qh_shift"].to(torch.uint8)) & 3
        q = (lo | (hi << 4)).to(torch.int32) - 32
        sc = f["sc"].view(r, nb, 16)[:, :, mp["sub"]].to(torch.float32)
        d = f["d"].to(torch.float32).view(r, nb, 1)
        return ((d * sc) * q.to(torch.float32)).view(r, n_in)  # ggml: y = d * sc[is] * q
    raise LaneError(f"no device decoder for {fmt.name}")


# ---------------------------------------------------------------------------------------------
# repack: raw GGUF rows -> fields


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float16 (little-endian bytes reinterpreted)."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _unpack_k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins (ggml get_scale_min_k4)."""
    lo_sc = s[..., 0:4] & 63
    lo_m = s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).contiguous(), torch.cat([lo_m, hi_m], -1).contiguous()


def repack(name: str, fmt: G, n_out: int, n_in: int, raw: torch.Tensor,
           scales: torch.Tensor | None = None, scale2: float | None = None,
           input_scale_inv: float | None = None) -> QWeight:
    """raw: uint8 [n_out, row_bytes] on the target device (GGUF row bytes) -> QWeight.
    NVFP4_E2M1 also takes its companions: scale bytes uint8 [n_out, n_in/16] and scale2."""
    if fmt not in DEVICE_FORMATS:
        raise LaneError(
            f"tensor {name!r}: dtype {fmt.name} has no exact device decoder in the engine "
            f"(served: {', '.join(f.name for f in DEVICE_FORMATS)})"
        )
    if n_in % BLOCK[fmt]:
        raise LaneError(f"tensor {name!r}: row length {n_in} is not a multiple of the {fmt.name} block")
    r = n_out
    if fmt in _nv.NVFP4_FORMATS:
        return QWeight(name, fmt, r, n_in, _nv.repack_fields(name, fmt, r, n_in, raw, scales, scale2,
                                                                input_scale_inv))
    if fmt == G.F32:
        return QWeight(name, fmt, r, n_in, {"w": raw.contiguous().view(torch.float32).clone()})
    if fmt == G.F16:
        return QWeight(name, fmt, r, n_in, {"w": raw.contiguous().view(torch.float16).clone()})
    if fmt == G.BF16:
        return QWeight(name, fmt, r, n_in, {"w": raw.contiguous().view(torch.bfloat16).clone()})
    if fmt in (G.Q8_0, G.Q4_0):
        bb = 34 if fmt == G.Q8_0 else 18
        b = raw.view(r, n_in // 32, bb)
        d = _f16(b[:, :, 0:2]).contiguous()
        qs = b[:, :, 2:].contiguous().view(r, -1)
        if fmt == G.Q8_0:
            qs = qs.view(torch.int8)
        return QWeight(name, fmt, r, n_in, {"qs": qs, "d": d})
    nb = n_in // QK
    if fmt in (G.Q4_K, G.Q5_K):
        bb = 144 if fmt == G.Q4_K else 176
        b = raw.view(r, nb, bb)
        sc, m = _unpack_k4_scales(b[:, :, 4:16])
        f = {"d": _f16(b[:, :, 0:2]).contiguous(), "dmin": _f16(b[:, :, 2:4]).contiguous(),
             "sc": sc.view(r, nb * 8), "m": m.view(r, nb * 8)}
        if fmt == G.Q4_K:
            f["qs"] = b[:, :, 16:144].contiguous().view(r, nb * 128)
        else:
            f["qh"] = b[:, :, 16:48].contiguous().view(r, nb * 32)
            f["qs"] = b[:, :, 48:176].contiguous().view(r, nb * 128)
        return QWeight(name, fmt, r, n_in, f)
    # Q6_K: ql[128] qh[64] scales[16] (int8) d (f16) = 210 bytes (ggml-common.h block_q6_K)
    b = raw.view(r, nb, 210)
    return QWeight(name, fmt, r, n_in, {
        "ql": b[:, :, 0:128].contiguous().view(r, nb * 128),
        "qh": b[:, :, 128:192].contiguous().view(r, nb * 64),
        "sc": b[:, :, 192:208].contiguous().view(torch.int8).view(r, nb * 16),
        "d": _f16(b[:, :, 208:210]).contiguous(),
    })


def raw_tensor(gguf, name: str, device: torch.device) -> torch.Tensor:
    """A tensor's GGUF bytes [n_rows, row_bytes] as a uint8 torch tensor on `device`."""
    arr = gguf.raw(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mmap view is read-only; it is copied right away
        t = torch.from_numpy(arr)
    if torch.device(device).type == "cpu":
        return t.clone()
    return t.to(device)


# The f16 scale fields whose values must be finite (ggml_validate_row_data's rule).
SCALE_FIELDS = {G.Q8_0: ("d",), G.Q4_0: ("d",), G.Q4_K: ("d", "dmin"), G.Q5_K: ("d", "dmin"), G.Q6_K: ("d",)}


def validate(w: QWeight) -> None:
    """Refuse non-finite values (F32/F16/BF16) or scales (block formats), naming the tensor and
    the first bad row/block, as muser.quant.validate_data does (ggml_validate_row_data)."""
    from ..errors import FormatError

    if w.fmt in _nv.NVFP4_FORMATS:
        return _nv.check_scales(w.name, w.fmt, w.fields)
    names = ("w",) if w.fmt in (G.F32, G.F16, G.BF16) else SCALE_FIELDS[w.fmt]
    for k in names:
        t = w.fields[k]
        bad = ~torch.isfinite(t.to(torch.float32) if t.dtype != torch.float32 else t)
        if bool(bad.any()):
            i = int(torch.nonzero(bad.reshape(-1))[0])
            what = "value" if k == "w" else f"scale {k!r}"
            per_row = t.shape[1] if t.dim() == 2 else 1
            raise FormatError(f"tensor {w.name!r}: non-finite {w.fmt.name} {what} at row {i // per_row}, "
                              f"{'element' if k == 'w' else 'block'} {i % per_row}")


def upload(gguf, name: str, device: torch.device) -> QWeight:
    """Read one 2-D weight from the GGUF, move it to `device`, repack and validate there."""
    info = gguf.tensors[name]
    n_in, n_out = info.shape[0], int(np.prod(info.shape[1:]))
    raw = raw_tensor(gguf, name, device)
    fmt = G(info.type.ggml_type)
    comp = _nv.companions(gguf, name, n_out, n_in, device) if fmt == G.NVFP4_E2M1 else (None, None, None)
    w = repack(name, fmt, n_out, n_in, raw, *comp)
    del raw
    validate(w)
    return w


def random_bytes(fmt: G, n_out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """Random valid stored data uint8 [n_out, row_bytes] of `fmt` (every packing bit random,
    f16 scale fields finite): the input of the decoder/kernel comparisons."""
    from ..gguf.types import type_info

    rng = np.random.default_rng(seed)
    n = n_out * n_in
    if fmt == G.F32:
        return rng.standard_normal(n).astype("<f4").view(np.uint8).reshape(n_out, -1)
    if fmt == G.F16:
        return rng.standard_normal(n).astype("<f2").view(np.uint8).reshape(n_out, -1)
    if fmt == G.BF16:
        bits = (rng.standard_normal(n).astype("<f4").view("<u4") >> 16).astype("<u2")
        return bits.view(np.uint8).reshape(n_out, -1)
    ti = type_info(fmt)
    b = rng.integers(0, 256, (n // ti.block_elems, ti.block_bytes), dtype=np.uint8)
    for at in _SCALE_OFFSETS[fmt]:
        d = rng.uniform(-2, 2, len(b)).astype("<f2")
        b[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(n_out, -1)


# byte offsets of the f16 scale fields in a block (ggml-common.h block_* structs)
_SCALE_OFFSETS = {G.Q8_0: (0,), G.Q4_0: (0,), G.Q4_K: (0, 2), G.Q5_K: (0, 2), G.Q6_K: (208,)}


def vector(gguf, name: str, device: torch.device) -> torch.Tensor:
    """A 1-D F32 tensor (norm weight) as f32 on `device`."""
    a = np.array(gguf.array(name), dtype=np.float32, copy=True).reshape(-1)
    return torch.from_numpy(a).to(device)
