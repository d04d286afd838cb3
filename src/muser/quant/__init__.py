"""Weight and activation formats (book chapters 5-7): numpy reference codecs, bit-exact to the
pinned ggml, and Muser's native NVFP4.

Weights
    dequantize(data u8 [nbytes], t, n_elements) -> f32 [n]      ggml dequantize_row_*, bit-exact
    dequantize_tensor(f, name) -> f32 [np_shape]                 incl. NVFP4_E2M1 + companions
    dequantize_rows(f, name, rows) -> f32 [len(rows), ne0]       decodes only those rows
    quantize(values f32 [..., n], t) -> u8 [rows, row_bytes]     llama.cpp quantize_row_*_ref, byte-identical
Activations (ggml-cpu, x86 AVX2 build)
    quantize_q8_K(x f32 [T, n]) -> Q8KActivation(d [T, nb], qs i8 [T, nb, 256], bsums i16 [T, nb, 16])
    quantize_q8_0(x f32 [T, n]) -> Q8_0Activation(d_bits u16 [T, nb], qs i8 [T, nb, 32])
Dots
    matmul_ggml(weight_bytes u8 [n_out, row_bytes], t, x f32 [T, n_in]) -> f32 [T, n_out]
    matmul_nvfp4_w4a16(w, x), matmul_nvfp4_w4a4(w, x)            book 7.4.2 / 7.4.3, integer-exact
NVFP4
    quantize_nvfp4(values f32 [n_out, n_in]) -> NVFP4Weight(packed, scales, scale2, input_scale_inv)
    read_nvfp4_weight(f, name), validate_nvfp4_pairing(f, names), E2M1 / E4M3FN tables (fp4)
"""

from .activation import Q8_0Activation, Q8KActivation, quantize_q8_0, quantize_q8_K
from .dequant import (
    dequantize,
    dequantize_nvfp4,
    dequantize_rows,
    dequantize_tensor,
    scale_min_k4,
    validate_data,
)
from .dot import VEC_DOT_TYPE, matmul_ggml
from .fp4 import E2M1_VALUES, E4M3FN_VALUES, e2m1_encode, e4m3fn_decode, e4m3fn_encode
from .nvfp4 import (
    NVFP4Weight,
    quantize_nvfp4,
    quantize_nvfp4_ggml,
    read_companions,
    read_nvfp4_weight,
    validate_nvfp4_pairing,
)
from .nvfp4_dot import (
    dequantize_act_nvfp4,
    matmul_nvfp4_w4a4,
    matmul_nvfp4_w4a16,
    quantize_act_nvfp4,
)
from .quantize import quantize

__all__ = [
    "dequantize", "dequantize_nvfp4", "dequantize_rows", "dequantize_tensor", "scale_min_k4",
    "validate_data", "quantize",
    "Q8KActivation", "Q8_0Activation", "quantize_q8_K", "quantize_q8_0",
    "VEC_DOT_TYPE", "matmul_ggml",
    "E2M1_VALUES", "E4M3FN_VALUES", "e2m1_encode", "e4m3fn_decode", "e4m3fn_encode",
    "NVFP4Weight", "quantize_nvfp4", "quantize_nvfp4_ggml", "read_companions", "read_nvfp4_weight",
    "validate_nvfp4_pairing",
    "quantize_act_nvfp4", "dequantize_act_nvfp4", "matmul_nvfp4_w4a16", "matmul_nvfp4_w4a4",
]
