"""Running the Triton kernels on the CPU under Triton's interpreter (TRITON_INTERPRET=1), as the
engine tests and `tools/device_kernels.py --device cpu` do."""

from __future__ import annotations

import os

import numpy as np


def compiled() -> bool:
    """Whether the Triton kernels are compiled (inline PTX allowed) rather than run by Triton's
    interpreter, which reads TRITON_INTERPRET when the kernels are decorated and has no PTX."""
    return not os.environ.get("TRITON_INTERPRET")


def interpreter_compat() -> None:
    """Two fixes to Triton 3.6's interpreter, installed once (idempotent; a no-op where Triton is
    absent):

    - a scalar kernel argument used as a loop bound becomes `int(array_of_shape_(1,))`, which
      numpy >= 2.4 refuses: the single element is read instead;
    - `tl.dot` runs as `np.matmul`, whose float BLAS kernels sum a row's products in an order that
      depends on the row's place in M (OpenBLAS sgemm: the same [16, 128] rows differ by an ulp at
      rows 0-15 and 48-63 of a [64, 128] operand), so a kernel that is row-invariant on the GPU
      (one mma order per element) would not be under the interpreter. The dot becomes one fixed
      order per element (einsum's sum of products along k, the same loop for every (i, j)); the
      accumulator is added after, as the interpreter does."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:
        return
    scope = it._LangPatchScope
    if getattr(scope, "_muser_compat", False):
        return
    original = scope.set_attr

    def set_attr(self, obj, name, value):
        if name == "__index__":
            value = lambda t: int(np.asarray(t.handle.data).reshape(-1)[0])  # noqa: E731
        return original(self, obj, name, value)

    scope.set_attr = set_attr
    original_dot = it.InterpreterBuilder.create_dot

    def values(h, acc):  # the interpreter holds bf16 as its uint16 bit patterns
        if h.dtype == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32).astype(acc)
        return h.data.astype(acc)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.is_floating() and a.dtype.primitive_bitwidth > 8 and b.dtype.primitive_bitwidth > 8:
            acc = d.data.dtype
            prod = np.einsum("...ik,...kj->...ij", values(a, acc), values(b, acc), optimize=False)
            return it.TensorHandle(prod + d.data, d.dtype.scalar)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)  # integer dots are exact

    it.InterpreterBuilder.create_dot = create_dot
    scope._muser_compat = True
