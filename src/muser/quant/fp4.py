"""The small float formats of NVFP4 (book 7.1): the E2M1 codebook, E4M3FN scales (Muser's
companion format), UE4M3 scales (ggml's NVFP4, type 40), and their round-to-nearest encoders.

Everything is a 16- or 256-entry table, so every decoder here is checked exhaustively.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError

F32 = np.float32

# Figure 7.1: code -> value; bit 3 is the sign, so codes 8..15 mirror 0..7 (8 is -0.0).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=F32,
)
# The same codebook in units of 1/2 (book 7.4.2 `e2m1_q1`; ggml-common.h kvalues_fp4 is exactly
# this table: "e2m1 values (doubled)").
E2M1_Q1 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)

# ModelOpt's e2m1 rounding boundaries (midpoints between neighbouring magnitudes). A magnitude
# equal to a boundary at an odd index rounds up, at an even index rounds down: ties go to the
# code with an even mantissa (book 7.2 "ties-to-even midpoints").
E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=F32)


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes (uint8 0..15), ModelOpt `_cast_fp4` semantics: code =
    #bounds strictly below |x| (+1 on a tie at an odd-index bound), saturating at 6.0; the sign
    bit is set for x < 0 (so -0.0 encodes as +0). NaN encodes as 7 (sorted past every bound)."""
    x = np.asarray(x, dtype=F32)
    a = np.abs(x)
    code = np.zeros(a.shape, dtype=np.uint8)
    for i, b in enumerate(E2M1_BOUNDS):  # even index: |x| > bound; odd index: |x| >= bound (tie up)
        code += (a >= b) if i % 2 else (a > b)
    code += np.isnan(a).view(np.uint8) * np.uint8(7)
    code |= (x < 0).view(np.uint8) << 3
    return code


# --- E4M3FN (OCP FP8, "finite": no infinities, NaN only at 0x7F / 0xFF) -------------------------


def _e4m3fn_table() -> np.ndarray:
    b = np.arange(256, dtype=np.int32)
    sign = np.where(b & 0x80, F32(-1.0), F32(1.0))
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(F32)
    mag = np.where(
        exp == 0,
        man * F32(2.0**-9),  # subnormal: man * 2^-6 / 8
        (F32(1.0) + man / F32(8.0)) * np.ldexp(F32(1.0), exp - 7).astype(F32),
    ).astype(F32)
    out = (sign * mag).astype(F32)
    out[(b & 0x7F) == 0x7F] = np.nan
    return out


E4M3FN_VALUES = _e4m3fn_table()  # [256] float32; NaN at 0x7F and 0xFF
E4M3FN_NAN = (0x7F, 0xFF)
E4M3FN_MAX = F32(448.0)
# Scale bytes as integers in units of 2^-9 (book 7.4.2 `e4m3_q9`): exact for every finite byte.
E4M3FN_Q9 = np.where(np.isnan(E4M3FN_VALUES), 0, E4M3FN_VALUES * 512.0).astype(np.int64)
# The 127 non-negative finite values, ascending with their codes 0x00..0x7E.
_POS = E4M3FN_VALUES[:0x7F].astype(np.float64)
_MID = ((_POS[:-1] + _POS[1:]) / 2.0).astype(F32)  # exact in f32 (5 significant bits)


def e4m3fn_decode(b: np.ndarray, what: str = "E4M3FN scale") -> np.ndarray:
    """Bytes -> float32; a NaN byte (0x7F / 0xFF) is a FormatError naming its flat index."""
    b = np.asarray(b, dtype=np.uint8)
    nan = (b & 0x7F) == 0x7F
    if nan.any():
        i = int(np.flatnonzero(nan.reshape(-1))[0])
        raise FormatError(f"{what}: NaN scale byte {int(b.reshape(-1)[i]):#04x} at index {i}")
    return E4M3FN_VALUES[b]


def e4m3fn_encode(x: np.ndarray) -> np.ndarray:
    """Non-negative float32 -> E4M3FN byte, round-to-nearest-even, saturating at 448
    (the torch `.to(float8_e4m3fn)` rounding ModelOpt relies on; inputs here are <= 448 by
    construction, the clamp only guards rounding at the top)."""
    x = np.asarray(x, dtype=F32)
    if (x < 0).any() or np.isnan(x).any():
        raise FormatError("e4m3fn_encode takes non-negative finite scales")
    i = np.searchsorted(_MID, x, side="left").astype(np.int32)  # codes whose lower midpoint < x
    # x exactly on a midpoint: searchsorted(left) picked the lower code; ties go to the even code.
    on_mid = (i < _MID.size) & (x == _MID[np.minimum(i, _MID.size - 1)])
    i = np.where(on_mid & (i % 2 == 1), i + 1, i)
    return np.minimum(i, 0x7E).astype(np.uint8)


# --- UE4M3 (ggml's NVFP4 block scales, ggml-impl.h) --------------------------------------------


def _ue4m3_table() -> np.ndarray:
    # ggml_ue4m3_to_fp32: 0 and 0x7F decode to 0; bit 7 is ignored (unsigned), and the value is
    # halved to match kvalues_fp4 (which are E2M1 doubled).
    b = np.arange(256, dtype=np.int32)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(F32)
    raw = np.where(
        exp == 0,
        np.ldexp(man, -9).astype(F32),
        np.ldexp(F32(1.0) + man / F32(8.0), exp - 7).astype(F32),
    ).astype(F32)
    out = (raw * F32(0.5)).astype(F32)
    out[(b == 0) | (b == 0x7F)] = 0.0
    return out


UE4M3_HALF_VALUES = _ue4m3_table()  # [256] float32, already x0.5


def ue4m3_encode(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3 (ggml-impl.h), bit for bit: truncating mantissa + one round bit
    (ties away), subnormals by (int)(x*512 + 0.5), overflow to 0x7E, non-positive to 0."""
    x = np.asarray(x, dtype=F32)
    pos = x > 0
    xc = np.where(x > F32(448.0), F32(448.0), x).astype(F32)
    bits = xc.view(np.uint32)
    e = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7
    man = ((bits >> 20) & 0x7).astype(np.int32) + ((bits >> 19) & 1).astype(np.int32)
    carry = man > 7
    man = np.where(carry, 0, man)
    e2 = np.where(carry, e + 1, e)
    normal = np.where(e2 >= 15, 0x7E, (e2 << 3) | man)
    sub = np.clip((xc * F32(512.0) + F32(0.5)).astype(np.int32), None, 7)
    sub = np.where(sub < 1, 0, sub)
    out = np.where(e <= 0, sub, np.where(e >= 15, 0x7E, normal))
    return np.where(pos, out, 0).astype(np.uint8)
