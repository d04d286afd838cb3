"""Running the Triton kernels on the CPU under Triton's interpreter (TRITON_INTERPRET=1), as the
engine tests and `tools/device_kernels.py --device cpu` do."""

from __future__ import annotations

import numpy as np


def index_compat() -> None:
    """Triton 3.6's interpreter turns a scalar kernel argument used as a loop bound into
    `int(array_of_shape_(1,))`, which numpy >= 2.4 refuses; read the single element instead.
    Idempotent; a no-op where Triton is absent."""
    try:
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
    scope._muser_compat = True
