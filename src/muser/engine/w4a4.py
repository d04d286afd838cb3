"""The W4A4 contraction with FP4 activations (book 7.4.3) on torch, for NVFP4 companion weights
whose file carries `.nvfp4_input_scale_inv` (muser.activation_precision = nvfp4).

Activations are quantized per 16 values to E2M1 codes + an E4M3FN scale byte against the
activation scale2 = 1 / input_scale_inv (the weight recipe, quant.nvfp4.quantize_groups); the
group dots are exact integers (E2M1 in units of 2^-1, E4M3FN in units of 2^-9); the epilogue
rounds in f32 in the pinned order, then once to f16:
    y = f32(f16(((f32(I) * 2^-20) * scale2) * (1 / input_scale_inv)))
The reference is muser.quant.matmul_nvfp4_w4a4 (numpy); this must match it bit for bit, which
`w4a4_gate` checks on every W4A4 projection of a file.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..errors import FormatError, LaneError
from ..gguf.types import GgmlType as G
from ..quant.fp4 import E2M1_BOUNDS, E2M1_Q1, E4M3FN_MAX, E4M3FN_Q9, E4M3FN_VALUES
from ..quant.nvfp4 import GROUP
from .weights import QWeight

_CHUNK = 32 << 20  # bytes of f64 group dots per output chunk


@lru_cache(maxsize=None)
def _tables(device: str) -> dict[str, torch.Tensor]:
    return {
        "bounds": torch.from_numpy(E2M1_BOUNDS.copy()).to(device),  # [7] f32
        "q1": torch.from_numpy(E2M1_Q1.astype(np.float64)).to(device),  # [16] E2M1 x 2
        "q9": torch.from_numpy(E4M3FN_Q9.copy()).to(device),  # [256] int64 E4M3FN x 2^9
        "e4m3": torch.from_numpy(E4M3FN_VALUES.copy()).to(device),  # [256] f32
    }


def quantize_act(x: torch.Tensor, scale2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x f32 [T, n] (n % 16 == 0), scale2 f32 [1] on x's device -> (E2M1 codes uint8 [T, n],
    E4M3FN scale bytes uint8 [T, n/16]): ModelOpt's recipe as quant.nvfp4.quantize_groups states
    it. No host sync (capture-safe)."""
    T, n = x.shape
    t = _tables(str(x.device))
    g = x.view(T, n // GROUP, GROUP)
    s2 = scale2.view(1, 1)
    per_block = g.abs().amax(-1) / (s2 * 6.0)  # f32: amax / (6 * scale2)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    # round-to-nearest-even to E4M3FN, saturating at 448 (torch's float8 cast is RNE)
    sbytes = torch.clamp(per_block, max=float(E4M3FN_MAX)).to(torch.float8_e4m3fn).view(torch.uint8)
    denom = t["e4m3"][sbytes.long()] * s2  # [T, G] f32
    scaled = g / denom[..., None]
    a = scaled.abs()
    code = torch.searchsorted(t["bounds"], a.contiguous(), right=False)  # bounds strictly below |x|
    b = t["bounds"]
    tie_up = (a == b[1]) | (a == b[3]) | (a == b[5])  # ties go to the even-mantissa code
    code = (code + tie_up.to(code.dtype)) | torch.where(scaled < 0, 8, 0)
    code = torch.where((denom == 0)[..., None], torch.zeros_like(code), code)
    return code.to(torch.uint8).view(T, n), sbytes


def matmul_w4a4(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """x f32 [T, n_in] -> f32 [T, n_out] (f16-rounded values), book 7.4.3. No host sync; a
    non-finite activation propagates to the logits (refused there, book 10.9)."""
    if w.fmt != G.NVFP4_E2M1 or "isi" not in w.fields:
        raise LaneError(f"tensor {w.name!r}: W4A4 needs an NVFP4_E2M1 weight with '.nvfp4_input_scale_inv'")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.n_in:
        raise FormatError(f"W4A4 matmul: activations must be float32 [T, {w.n_in}], got {x.dtype} {list(x.shape)}")
    t = _tables(str(x.device))
    T, Gn = x.shape[0], w.n_in // GROUP
    s2 = w.fields["s2"][:1]  # f32 [1]
    inv = 1.0 / w.fields["isi"][:1]  # f32 [1]: the activation scale2, 1 / input_scale_inv
    ac, asb = quantize_act(x, inv)
    aq = t["q1"][ac.long()].view(T, Gn, GROUP)  # [T, G, 16] f64 small ints
    aq9 = t["q9"][asb.long()]  # [T, G] int64
    out = torch.empty((T, w.n_out), dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK // max(1, T * Gn * 8))
    qs, sc = w.fields["qs"], w.fields["sc"]
    for o0 in range(0, w.n_out, step):
        p = qs[o0:o0 + step]
        codes = torch.stack([p & 0xF, p >> 4], -1).view(p.shape[0], Gn, GROUP).long()
        wq = t["q1"][codes]  # [O, G, 16]
        dots = torch.einsum("tgk,ogk->tog", aq, wq).round().to(torch.int64)  # exact: |sum| <= 2304
        wq9 = t["q9"][sc[o0:o0 + step].long()]  # [O, G]
        I = (dots * wq9[None] * aq9[:, None]).sum(-1)  # int64 [T, O], exact
        y = I.to(torch.float32) * np.float32(2.0 ** -20)
        y = (y * s2) * inv
        out[:, o0:o0 + step] = y.to(torch.float16).to(torch.float32)  # the f16 output boundary
    return out


def w4a4_gate(path, n_rows: int = 16, seed: int = 0) -> dict:
    """Every W4A4 projection of the file, engine torch contraction vs the numpy reference
    (quant.matmul_nvfp4_w4a4) on `n_rows` activation rows: pass iff bit-identical everywhere.
    A file without W4A4 weights is refused (W4A16 has no FP4-activation path)."""
    from ..model.loader import open_model
    from ..quant import matmul_nvfp4_w4a4, read_nvfp4_weight
    from .weights import upload

    m = open_model(path)
    try:
        names = [n for n in m.contract.nvfp4 if n + ".nvfp4_input_scale_inv" in m.gguf.tensors]
        if not names:
            raise LaneError(f"{str(path)!r} has no W4A4 weights (muser.activation_precision is not nvfp4)")
        rng = np.random.default_rng(seed)
        worst, checked = 0, 0
        for name in names:
            w = upload(m.gguf, name, torch.device("cpu"))
            x = (rng.standard_normal((n_rows, w.n_in)) * rng.uniform(0.01, 10)).astype(np.float32)
            ref = matmul_nvfp4_w4a4(read_nvfp4_weight(m.gguf, name), x)
            got = matmul_w4a4(w, torch.from_numpy(x)).numpy()
            worst = max(worst, int(np.count_nonzero(got.view(np.int32) != ref.view(np.int32))))
            checked += 1
        return {"status": "pass" if worst == 0 else "fail", "weights": checked, "rows": n_rows,
                "bound": "bit-identical (0 ulp)", "max_mismatched_values": worst}
    finally:
        m.close()
