"""NVFP4 weights on the device (book 7.1-7.3): Muser's native companion form (NVFP4_E2M1 payload
+ `.nvfp4_scale` E4M3FN bytes + `.nvfp4_scale2` f32) and ggml's NVFP4 (type 40, block_nvfp4).

Resident layout (fields of a QWeight, rows = n_out):
    NVFP4_E2M1  qs uint8 [r, n_in/2]  (low nibble = even index), sc uint8 E4M3FN [r, n_in/16],
                s2 f32 [r]  (the tensor's one scale2, repeated per row so that row slices and
                gathers of the fields stay self-contained: 4 bytes a row)
    NVFP4       qs uint8 [r, n_in/2]  (per 16-value sub-block: low nibble j, high nibble j + 8),
                d  uint8 UE4M3 [r, n_in/16]
The bytes are the file's bytes, moved apart; nothing is decoded at load.

Decoders evaluate, in f32 with one rounding per operation, exactly what the numpy codecs of
muser.quant.dequant evaluate (and the same lookup tables): companion `(e2m1 * e4m3fn) * scale2`
(dequantize_nvfp4), ggml `kvalues_fp4[q] * ue4m3_half(d)` (ggml-quants.c dequantize_row_nvfp4).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..errors import FormatError, LaneError
from ..gguf.types import GgmlType as G
from ..quant.fp4 import E2M1_Q1, E2M1_VALUES, E4M3FN_VALUES, UE4M3_HALF_VALUES
from ..quant.nvfp4 import GROUP, INPUT_SCALE_INV_SUFFIX, SCALE2_SUFFIX, SCALE_SUFFIX

NVFP4_FORMATS = (G.NVFP4_E2M1, G.NVFP4)
FIELDS = {G.NVFP4_E2M1: ("qs", "sc", "s2"), G.NVFP4: ("qs", "d")}
BLOCK = {G.NVFP4_E2M1: GROUP, G.NVFP4: 64}
GGML_BLOCK_BYTES = 36  # ggml-common.h block_nvfp4: d[4] (UE4M3) + qs[32]


@lru_cache(maxsize=None)
def _tables(device: str) -> dict[str, torch.Tensor]:
    """The numpy codecs' own tables as f32 device tensors (index = code or byte)."""
    return {
        "e2m1": torch.from_numpy(E2M1_VALUES.copy()).to(device),  # [16]
        "q1": torch.from_numpy(E2M1_Q1.astype(np.float32)).to(device),  # [16] ggml kvalues_fp4
        "e4m3": torch.from_numpy(E4M3FN_VALUES.copy()).to(device),  # [256] (NaN bytes refused at load)
        "ue4m3": torch.from_numpy(UE4M3_HALF_VALUES.copy()).to(device),  # [256] already x0.5
    }


def repack_fields(name: str, fmt: G, n_out: int, n_in: int, raw: torch.Tensor,
                  scales: torch.Tensor | None = None, scale2: float | None = None,
                  input_scale_inv: float | None = None) -> dict[str, torch.Tensor]:
    """raw uint8 [n_out, row_bytes] (GGUF rows) [+ companion scale bytes uint8 [n_out, n_in/16],
    scale2 and, for W4A4 files, input_scale_inv] -> the resident fields (module doc)."""
    if n_in % BLOCK[fmt]:
        raise LaneError(f"tensor {name!r}: row length {n_in} is not a multiple of the {fmt.name} block")
    r = n_out
    _tables(str(raw.device))  # built here, not first inside a captured CUDA graph (embedding rows)
    if fmt == G.NVFP4:
        b = raw.view(r, n_in // 64, GGML_BLOCK_BYTES)
        return {"qs": b[:, :, 4:].contiguous().view(r, n_in // 2),
                "d": b[:, :, :4].contiguous().view(r, n_in // GROUP)}
    if scales is None or scale2 is None:
        raise LaneError(f"tensor {name!r}: NVFP4_E2M1 needs its '{SCALE_SUFFIX}' and '{SCALE2_SUFFIX}' companions")
    if tuple(scales.shape) != (r, n_in // GROUP) or tuple(raw.shape) != (r, n_in // 2):
        raise LaneError(f"tensor {name!r}: payload {list(raw.shape)} / scales {list(scales.shape)} do not "
                        f"match [{r}, {n_in}]")
    s2 = torch.full((r,), float(np.float32(scale2)), dtype=torch.float32, device=raw.device)
    f = {"qs": raw.contiguous(), "sc": scales.contiguous(), "s2": s2}
    if input_scale_inv is not None:  # W4A4 (engine/w4a4.py), per row like s2
        f["isi"] = torch.full((r,), float(np.float32(input_scale_inv)), dtype=torch.float32, device=raw.device)
    return f


def decode_fields(fmt: G, f: dict[str, torch.Tensor], n_in: int) -> torch.Tensor:
    """The torch reference decoder of the resident layout: f32 [r, n_in], bit-exact with
    muser.quant.dequant (dequantize_nvfp4 / dequantize for type 40)."""
    qs = f["qs"]
    r = qs.shape[0]
    t = _tables(str(qs.device))
    if fmt == G.NVFP4_E2M1:
        codes = torch.stack([qs & 0xF, qs >> 4], -1).view(r, n_in // GROUP, GROUP).long()  # [r, g, 16]
        e = t["e2m1"][codes]
        s = t["e4m3"][f["sc"].long()].view(r, n_in // GROUP, 1)
        return ((e * s) * f["s2"].view(r, 1, 1)).view(r, n_in)  # (e2m1 * e4m3fn) * scale2, book 7.2
    if fmt == G.NVFP4:
        q = qs.view(r, n_in // GROUP, 8)
        codes = torch.cat([q & 0xF, q >> 4], -1).long()  # [r, g, 16]: low nibble j, high j + 8
        d = t["ue4m3"][f["d"].long()].view(r, n_in // GROUP, 1)
        return (t["q1"][codes] * d).view(r, n_in)  # ggml: kvalues_fp4[q] * ue4m3_to_fp32(d)
    raise LaneError(f"no NVFP4 decoder for {fmt.name}")


def check_scales(name: str, fmt: G, f: dict[str, torch.Tensor]) -> None:
    """A NaN E4M3FN scale byte (0x7F / 0xFF) is refused, naming the tensor, row and 16-value
    block (as quant.nvfp4.read_companions does). Every UE4M3 byte of type 40 is a valid scale."""
    if fmt != G.NVFP4_E2M1:
        return
    sc = f["sc"]
    bad = (sc & 0x7F) == 0x7F
    if bool(bad.any()):
        i = int(torch.nonzero(bad.reshape(-1))[0])
        g = sc.shape[1]
        raise FormatError(f"tensor {name!r}: NaN E4M3FN scale byte {int(sc.reshape(-1)[i]):#04x} at row {i // g}, "
                          f"block {i % g}")


def companions(gguf, name: str, n_out: int, n_in: int,
               device: torch.device) -> tuple[torch.Tensor, float, float | None]:
    """`<name>`'s scale bytes uint8 [n_out, n_in/16] on `device`, its f32 scale2 and its
    input_scale_inv (None for W4A16), each validated by the file's contract, checked again here."""
    from .weights import raw_tensor

    sname, s2name = name + SCALE_SUFFIX, name + SCALE2_SUFFIX
    for c in (sname, s2name):
        if c not in gguf.tensors:
            raise FormatError(f"missing NVFP4 companion tensor {c!r}")
    sc = raw_tensor(gguf, sname, device).reshape(n_out, n_in // GROUP)
    vals = []
    for c in (s2name, name + INPUT_SCALE_INV_SUFFIX):
        if c not in gguf.tensors:
            vals.append(None)
            continue
        v = np.float32(np.asarray(gguf.array(c)).reshape(-1)[0])
        if not (np.isfinite(v) and v > 0):
            raise FormatError(f"NVFP4 companion {c!r} must be finite and positive, got {float(v)!r}")
        vals.append(float(v))
    return sc, vals[0], vals[1]


def random_bytes(fmt: G, n_out: int, n_in: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray | None, float | None]:
    """Random valid stored data: (payload uint8 [n_out, row_bytes], companion scale bytes or None,
    scale2 or None). Every code and every non-NaN scale byte is reachable."""
    rng = np.random.default_rng(seed)
    if fmt == G.NVFP4:
        return rng.integers(0, 256, (n_out, n_in // 64 * GGML_BLOCK_BYTES), dtype=np.uint8), None, None
    payload = rng.integers(0, 256, (n_out, n_in // 2), dtype=np.uint8)
    sc = rng.integers(0, 256, (n_out, n_in // GROUP), dtype=np.uint8)
    sc[(sc & 0x7F) == 0x7F] &= 0xFE  # no NaN bytes (0x7F -> 0x7E, 0xFF -> 0xFE)
    return payload, sc, float(np.float32(rng.uniform(1e-4, 1e-2)))
