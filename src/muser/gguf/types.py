"""The tensor type table: every dtype id Muser will meet in a GGUF, with its block geometry.

ggml's ids and (elements per block, bytes per block) are ggml facts (ggml.h, ggml.c type_traits);
Muser's own NVFP4 companion types are ids 1000/1001 (book 6.1). An id not in this table is
refused by the reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ..errors import GGUFError


class GgmlType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40  # ggml's NVFP4: 64-element blocks, 4 UE4M3 scales + 32 payload bytes
    Q1_0 = 41
    # Muser's own (book 6.1): the native NVFP4 payload and its companion scale bytes.
    NVFP4_E2M1 = 1000  # two E2M1 values per byte; scales live in companion tensors
    F8_E4M3FN = 1001  # raw E4M3FN bytes, only in `<name>.nvfp4_scale`


@dataclass(frozen=True)
class TypeInfo:
    ggml_type: GgmlType
    block_elems: int  # elements per block
    block_bytes: int  # bytes per block

    @property
    def name(self) -> str:
        return self.ggml_type.name

    @property
    def bits_per_element(self) -> float:
        return self.block_bytes * 8 / self.block_elems

    def nbytes(self, n_elements: int) -> int:
        return n_elements // self.block_elems * self.block_bytes


_GEOMETRY: dict[GgmlType, tuple[int, int]] = {
    GgmlType.F32: (1, 4),
    GgmlType.F16: (1, 2),
    GgmlType.Q4_0: (32, 18),
    GgmlType.Q4_1: (32, 20),
    GgmlType.Q5_0: (32, 22),
    GgmlType.Q5_1: (32, 24),
    GgmlType.Q8_0: (32, 34),
    GgmlType.Q8_1: (32, 40),
    GgmlType.Q2_K: (256, 84),
    GgmlType.Q3_K: (256, 110),
    GgmlType.Q4_K: (256, 144),
    GgmlType.Q5_K: (256, 176),
    GgmlType.Q6_K: (256, 210),
    GgmlType.Q8_K: (256, 292),
    GgmlType.IQ2_XXS: (256, 66),
    GgmlType.IQ2_XS: (256, 74),
    GgmlType.IQ3_XXS: (256, 98),
    GgmlType.IQ1_S: (256, 50),
    GgmlType.IQ4_NL: (32, 18),
    GgmlType.IQ3_S: (256, 110),
    GgmlType.IQ2_S: (256, 82),
    GgmlType.IQ4_XS: (256, 136),
    GgmlType.I8: (1, 1),
    GgmlType.I16: (1, 2),
    GgmlType.I32: (1, 4),
    GgmlType.I64: (1, 8),
    GgmlType.F64: (1, 8),
    GgmlType.IQ1_M: (256, 56),
    GgmlType.BF16: (1, 2),
    GgmlType.TQ1_0: (256, 54),
    GgmlType.TQ2_0: (256, 66),
    GgmlType.MXFP4: (32, 17),
    GgmlType.NVFP4: (64, 36),
    GgmlType.Q1_0: (128, 18),
    GgmlType.NVFP4_E2M1: (2, 1),
    GgmlType.F8_E4M3FN: (1, 1),
}

TYPES: dict[int, TypeInfo] = {int(t): TypeInfo(t, *g) for t, g in _GEOMETRY.items()}


def type_info(type_id: int) -> TypeInfo:
    """Geometry of a dtype id; an unknown id is a GGUFError naming it."""
    try:
        return TYPES[int(type_id)]
    except KeyError:
        raise GGUFError(f"unknown tensor dtype id {type_id}") from None


def type_by_name(name: str) -> TypeInfo:
    try:
        return TYPES[int(GgmlType[name.upper()])]
    except KeyError:
        raise GGUFError(f"unknown tensor dtype name {name!r}") from None
