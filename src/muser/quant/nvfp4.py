"""NVFP4 (book chapter 7): Muser's native companion format, its ModelOpt quantizer, the
load-time pairing rules of 7.3, and ggml's own NVFP4 (type 40) reference quantizer.

Muser's native format (7.1, 7.3), for a weight `<name>` of GGUF shape [n_in, n_out]:
    <name>                         NVFP4_E2M1  [n_in, n_out]      two E2M1 codes per byte,
                                                                   low nibble = even index
    <name>.nvfp4_scale             F8_E4M3FN   [n_in/16, n_out]   one scale byte per 16 values
    <name>.nvfp4_scale2            F32         [1]                finite, positive
    <name>.nvfp4_input_scale_inv   F32         [1]                only when
                                                                   muser.activation_precision = nvfp4
value = (e2m1 * e4m3fn) * scale2, in that order (dequant.dequantize_nvfp4).

ggml's NVFP4 (ggml-common.h block_nvfp4): 64 values in 36 bytes, 4 UE4M3 scales (one per 16,
decoded x0.5 against the doubled E2M1 table) then 32 payload bytes where, inside each
16-value sub-block, the low nibble is element j and the high nibble element j + 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FormatError, MetadataError
from ..gguf.types import GgmlType as G
from .common import F32, check_finite
from .fp4 import (
    E2M1_Q1,
    E4M3FN_MAX,
    E4M3FN_VALUES,
    UE4M3_HALF_VALUES,
    e2m1_encode,
    e4m3fn_encode,
    ue4m3_encode,
)

GROUP = 16  # values per E4M3FN scale
SCALE_SUFFIX = ".nvfp4_scale"
SCALE2_SUFFIX = ".nvfp4_scale2"
INPUT_SCALE_INV_SUFFIX = ".nvfp4_input_scale_inv"
COMPANION_SUFFIXES = (SCALE_SUFFIX, SCALE2_SUFFIX, INPUT_SCALE_INV_SUFFIX)

WEIGHT_PRECISION_KEY = "muser.weight_precision"
ACTIVATION_PRECISION_KEY = "muser.activation_precision"
# Values `muser quantize` writes (and the loader accepts): the --to names; nvfp4-w4a4 is
# weight_precision "nvfp4" + activation_precision "nvfp4".
WEIGHT_PRECISIONS = frozenset(
    {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_xl", "nvfp4", "nvfp4-ggml"}
)
ACTIVATION_PRECISIONS = frozenset({"nvfp4"})


# --- Muser's native format ---------------------------------------------------------------------


@dataclass(frozen=True)
class NVFP4Weight:
    packed: np.ndarray  # uint8 [n_out, n_in/2]
    scales: np.ndarray  # uint8 E4M3FN [n_out, n_in/16]
    scale2: np.float32
    input_scale_inv: np.float32 | None = None  # W4A4 only

    @property
    def n_out(self) -> int:
        return self.packed.shape[0]

    @property
    def n_in(self) -> int:
        return 2 * self.packed.shape[1]

    def codes(self) -> np.ndarray:
        """E2M1 codes uint8 [n_out, n_in] (low nibble = even index)."""
        return np.stack([self.packed & 0xF, self.packed >> 4], axis=-1).reshape(self.n_out, self.n_in)

    def dequantize(self) -> np.ndarray:
        from .dequant import dequantize_nvfp4

        return dequantize_nvfp4(self.packed, self.scales, self.scale2)


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes [..., n] -> bytes [..., n/2]: even index in the low nibble (Figure 7.2)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def nvfp4_scale2(values: np.ndarray) -> np.float32:
    """ModelOpt weights_scaling_factor_2 = amax / (6 * 448): the largest block scale then lands
    on E4M3FN's maximum. An all-zero tensor gets scale2 = 1 (every value decodes to exactly 0)."""
    amax = F32(np.abs(values).max()) if values.size else F32(0)
    if amax == 0:
        return F32(1.0)
    s2 = F32(amax / F32(6.0 * 448.0))
    if not s2 > 0:
        raise FormatError(f"NVFP4: tensor amax {float(amax)!r} is too small for a positive f32 scale2")
    return s2


def quantize_groups(x: np.ndarray, scale2: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """ModelOpt NVFP4QTensor.quantize for given scale2: x f32 [..., n] (n % 16 == 0) ->
    (E2M1 codes uint8 [..., n], E4M3FN scale bytes uint8 [..., n/16]).

    per_block_scale = amax16 / (6 * scale2) (a zero becomes 1.0, as ModelOpt does), cast to
    E4M3FN round-to-nearest-even (saturating at 448); codes = e2m1(x / (scale_f8 * scale2)) with
    the ties-to-even boundaries. A group whose scale byte rounds to zero stores code 0."""
    x = np.asarray(x, dtype=F32)
    *lead, n = x.shape
    g = x.reshape(*lead, n // GROUP, GROUP)
    bamax = np.abs(g).max(axis=-1)
    per_block = (bamax / (F32(6.0) * F32(scale2))).astype(F32)
    per_block = np.where(per_block == 0, F32(1.0), per_block)
    sbytes = e4m3fn_encode(np.minimum(per_block, E4M3FN_MAX))
    denom = (E4M3FN_VALUES[sbytes] * F32(scale2)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = (g / denom[..., None]).astype(F32)
    codes = np.where((denom == 0)[..., None], np.uint8(0), e2m1_encode(scaled))
    return codes.reshape(*lead, n).astype(np.uint8), sbytes


def quantize_nvfp4(values: np.ndarray, input_scale_inv: float | None = None) -> NVFP4Weight:
    """float32 [n_out, n_in] (numpy order; n_in % 16 == 0) -> Muser NVFP4 (ModelOpt recipe)."""
    w = np.asarray(values)
    if w.dtype != np.float32 or w.ndim != 2:
        raise FormatError(f"quantize_nvfp4 takes float32 [n_out, n_in], got {w.dtype} {list(w.shape)}")
    if w.shape[1] % GROUP:
        raise FormatError(f"NVFP4: row length {w.shape[1]} is not a multiple of {GROUP}")
    check_finite(w, "quantize to NVFP4")
    s2 = nvfp4_scale2(w)
    codes, sbytes = quantize_groups(w, s2)
    isi = None
    if input_scale_inv is not None:
        isi = F32(input_scale_inv)
        if not (np.isfinite(isi) and isi > 0):
            raise FormatError(f"NVFP4 input_scale_inv must be finite and positive, got {input_scale_inv!r}")
    return NVFP4Weight(pack_codes(codes), sbytes, s2, isi)


# --- ggml's NVFP4 (type 40) --------------------------------------------------------------------


_NVFP4_GGML_SLICE = 1 << 10  # blocks per pass of the code scan: its temporaries stay in cache
_E2M1_Q1_POS = E2M1_Q1[:8].astype(F32)  # kvalues_fp4[0..7], the non-negative half


def _amax16(a: np.ndarray) -> np.ndarray:
    """Row maxima of non-negative [n, 16] by halving (exact; a reduction over 16-wide rows is
    several times slower)."""
    h = np.maximum(a[:, :8], a[:, 8:])
    h = np.maximum(h[:, :4], h[:, 4:])
    h = np.maximum(h[:, :2], h[:, 2:])
    return np.maximum(h[:, 0], h[:, 1])


def quantize_nvfp4_ggml(x: np.ndarray) -> np.ndarray:
    """ggml-quants.c quantize_row_nvfp4_ref: float32 [nb, 64] -> block_nvfp4 bytes [nb, 36].

    Per 16-sub-block: ue = ggml_fp32_to_ue4m3(amax / 6), d = ggml_ue4m3_to_fp32(ue) (halved);
    each value takes the first index i minimising fabsf(kvalues_fp4[i] * d - x)
    (best_index_mxfp4's strict '<' scan over all 16 codes).

    The scan runs over the 8 magnitudes only, with the same float32 errors: for x < 0 the
    error of code 8 + k is fabsf(-(k_v * d) + |x|) = the error of code k at |x| (rounding is
    sign-symmetric), and every code of the other sign, and -0 (code 8), errs by >= |x| = the
    error of code 0, which the scan meets first. So code = first argmin over magnitudes at |x|,
    plus the sign bit when x < 0 and the magnitude is not 0."""
    x = np.asarray(x, dtype=F32)
    nb = x.shape[0]
    ue = ue4m3_encode((_amax16(np.abs(x.reshape(nb * 4, 16))) / F32(6.0)).astype(F32))  # [nb*4]
    d = UE4M3_HALF_VALUES[ue]
    out = np.empty((nb, 36), dtype=np.uint8)
    out[:, 0:4] = ue.reshape(nb, 4)
    for b0 in range(0, nb, _NVFP4_GGML_SLICE):
        n = min(_NVFP4_GGML_SLICE, nb - b0)
        sub = x[b0 : b0 + n].reshape(n * 4, 16)
        a = np.abs(sub)  # [n*4, 16]
        dv = np.repeat(d[b0 * 4 : (b0 + n) * 4], 16).reshape(a.shape)  # each value's d
        best = a.copy()  # the error of code 0: fabsf(0 * d - |x|) = |x|
        idx = np.zeros(a.shape, dtype=np.uint8)
        err = np.empty_like(a)
        lt = np.empty(a.shape, dtype=bool)
        kk = np.empty(a.shape, dtype=np.uint8)
        for k in range(1, 8):
            np.multiply(dv, _E2M1_Q1_POS[k], out=err)  # kvalues[k] * d
            np.subtract(err, a, out=err)
            np.abs(err, out=err)
            np.less(err, best, out=lt)  # strict: the first minimum wins
            np.minimum(err, best, out=best)
            np.multiply(lt.view(np.uint8), np.uint8(k), out=kk)
            np.maximum(idx, kk, out=idx)  # idx < k before step k: max == "k where lt"
        idx |= ((sub < 0) & (idx > 0)).view(np.uint8) << 3
        q = idx.reshape(n, 4, 16)
        out[b0 : b0 + n, 4:36] = (q[..., :8] | (q[..., 8:] << 4)).reshape(n, 32)  # low j, high j + 8
    return out


# --- companions in a GGUF and the pairing rules of 7.3 ------------------------------------------


def _scalar(f, name: str) -> np.float32:
    t = f.tensors.get(name)
    if t is None:
        raise FormatError(f"missing NVFP4 companion tensor {name!r}")
    if t.type.ggml_type != G.F32 or tuple(t.shape) != (1,):
        raise FormatError(
            f"NVFP4 companion {name!r} must be an F32 scalar [1], got {t.type.name} {list(t.shape)}"
        )
    v = F32(f.array(name).reshape(-1)[0])
    if not (np.isfinite(v) and v > 0):
        raise FormatError(f"NVFP4 companion {name!r} must be finite and positive, got {float(v)!r}")
    return v


def read_companions(f, name: str) -> tuple[np.ndarray, np.float32]:
    """Validate and return `<name>`'s E4M3FN scale bytes uint8 [n_out, n_in/16] and f32 scale2."""
    t = f.tensor_info(name)
    if t.type.ggml_type != G.NVFP4_E2M1:
        raise FormatError(f"tensor {name!r} is {t.type.name}, not NVFP4_E2M1")
    if len(t.shape) != 2 or t.shape[0] % GROUP:
        raise FormatError(
            f"NVFP4 tensor {name!r}: shape {list(t.shape)} must be [n_in, n_out] with n_in % {GROUP} == 0"
        )
    n_in, n_out = t.shape
    sname = name + SCALE_SUFFIX
    s = f.tensors.get(sname)
    if s is None:
        raise FormatError(f"missing NVFP4 companion tensor {sname!r}")
    want = (n_in // GROUP, n_out)
    if s.type.ggml_type != G.F8_E4M3FN or tuple(s.shape) != want:
        raise FormatError(
            f"NVFP4 companion {sname!r} must be F8_E4M3FN {list(want)}, got {s.type.name} {list(s.shape)}"
        )
    scales = f.raw(sname).reshape(n_out, n_in // GROUP)
    nan = (scales & 0x7F) == 0x7F
    if nan.any():
        i = int(np.flatnonzero(nan.reshape(-1))[0])
        raise FormatError(
            f"NVFP4 companion {sname!r}: NaN scale byte {int(scales.reshape(-1)[i]):#04x} at index {i} "
            f"(row {i // scales.shape[1]}, group {i % scales.shape[1]})"
        )
    return scales, _scalar(f, name + SCALE2_SUFFIX)


def read_nvfp4_weight(f, name: str) -> NVFP4Weight:
    scales, s2 = read_companions(f, name)
    isi_name = name + INPUT_SCALE_INV_SUFFIX
    isi = _scalar(f, isi_name) if isi_name in f.tensors else None
    return NVFP4Weight(f.raw(name), scales, s2, isi)


def _precision(f, key: str, allowed: frozenset[str]) -> str | None:
    if key not in f:
        return None
    v = f.get_str(key)  # WrongKeyType for a non-string
    if v not in allowed:
        raise MetadataError(f"metadata key {key!r} has unknown value {v!r} (known: {', '.join(sorted(allowed))})")
    return v


def validate_nvfp4_pairing(f, nvfp4_names: list[str]) -> None:
    """Book 7.3, failing closed: muser.weight_precision says nvfp4 iff native NVFP4_E2M1 tensors
    exist; every native tensor carries its F8_E4M3FN scale [n_in/16, n_out] (no NaN byte) and an
    F32 scalar scale2 (finite, positive); `.nvfp4_input_scale_inv` is present on every native
    tensor iff muser.activation_precision = nvfp4 (and on none otherwise); no companion or
    companion-typed tensor exists without its native weight."""
    native = list(nvfp4_names)
    names = set(native)
    for t in f.tensors.values():
        gt = t.type.ggml_type
        if gt == G.NVFP4_E2M1 and t.name not in names:
            raise FormatError(f"NVFP4_E2M1 tensor {t.name!r} is not a recognised native weight")
        base = next((t.name[: -len(s)] for s in COMPANION_SUFFIXES if t.name.endswith(s)), None)
        if base is not None and base not in names:
            raise FormatError(f"NVFP4 companion {t.name!r} has no NVFP4_E2M1 weight {base!r}")
        if gt == G.F8_E4M3FN and not t.name.endswith(SCALE_SUFFIX):
            raise FormatError(f"F8_E4M3FN tensor {t.name!r} is not an '{SCALE_SUFFIX}' companion")
    wp = _precision(f, WEIGHT_PRECISION_KEY, WEIGHT_PRECISIONS)
    ap = _precision(f, ACTIVATION_PRECISION_KEY, ACTIVATION_PRECISIONS)
    if native and wp != "nvfp4":
        raise FormatError(
            f"{len(native)} native NVFP4 tensor(s) (first {native[0]!r}) but {WEIGHT_PRECISION_KEY} "
            f"is {wp!r}, must be 'nvfp4'"
        )
    if wp == "nvfp4" and not native:
        raise FormatError(f"{WEIGHT_PRECISION_KEY} is 'nvfp4' but the file has no NVFP4_E2M1 tensors")
    if wp == "nvfp4-ggml" and not any(t.type.ggml_type == G.NVFP4 for t in f.tensors.values()):
        raise FormatError(f"{WEIGHT_PRECISION_KEY} is 'nvfp4-ggml' but the file has no NVFP4 (type 40) tensors")
    if ap == "nvfp4" and not native:
        raise FormatError(f"{ACTIVATION_PRECISION_KEY} is 'nvfp4' but the file has no NVFP4_E2M1 tensors")
    for name in native:
        read_companions(f, name)
        isi = name + INPUT_SCALE_INV_SUFFIX
        if ap == "nvfp4":
            if isi not in f.tensors:
                raise FormatError(f"{ACTIVATION_PRECISION_KEY} is 'nvfp4' but {isi!r} is missing")
            _scalar(f, isi)
        elif isi in f.tensors:
            raise FormatError(
                f"{isi!r} is present but {ACTIVATION_PRECISION_KEY} is {ap!r}, not 'nvfp4' (W4A16 has no input scale)"
            )


__all__ = [
    "NVFP4Weight", "quantize_nvfp4", "quantize_groups", "quantize_nvfp4_ggml", "pack_codes",
    "nvfp4_scale2", "read_companions", "read_nvfp4_weight", "validate_nvfp4_pairing",
    "COMPANION_SUFFIXES", "WEIGHT_PRECISION_KEY", "ACTIVATION_PRECISION_KEY",
]
