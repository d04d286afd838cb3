"""Engine test fixtures. Triton kernels run here under the Triton interpreter (TRITON_INTERPRET=1,
set per kernel test) on tiny shapes; the same kernels run compiled on the GPU machine."""

from __future__ import annotations

import os
import sys

import pytest

# The interpreter must be chosen before triton itself is imported (triton.language's own helpers
# are decorated at import). Only on machines without CUDA: there the kernels cannot run compiled.
if "triton" not in sys.modules:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


from muser.engine.kernels.interpreter import interpreter_compat  # noqa: E402

interpreter_compat()


@pytest.fixture(scope="module")
def kernels():
    """The Triton kernel modules re-imported under the interpreter (TRITON_INTERPRET=1 is read
    when a kernel is decorated), restored to compiled kernels afterwards. The kernels then run
    on CPU tensors with the interpreter's numpy semantics (no FMA contraction)."""
    import importlib

    from muser.engine.kernels import attention, qmatvec

    if not qmatvec.HAVE_TRITON:
        pytest.fail("triton is not installed (it is pinned in the test extra)")
    import triton.language as tl

    if type(tl.zeros).__name__ != "InterpretedFunction":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 could be set; run the engine "
                    "kernel tests in a process where tests/engine/conftest.py loads first")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield importlib.reload(qmatvec), importlib.reload(attention)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
        importlib.reload(qmatvec)
        importlib.reload(attention)
