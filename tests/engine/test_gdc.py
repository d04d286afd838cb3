"""Which launches take programmatic dependent launch (engine/kernels/gdc.py): compiled kernels on
a GPU of compute capability 9 or later, at most 16 rows (the decode and verify steps' launches,
not prefill chunks), ENABLED; never the interpreter or the CPU. The PTX order each PDL kernel
keeps is checked by tools/triton_aot_check.py (tests/engine/test_triton_compile.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from muser.engine.kernels import gdc


def _on_gpu(rows: int):
    return SimpleNamespace(device=SimpleNamespace(type="cuda", index=0), shape=(rows, 64))


def test_pdl_for_launches_of_up_to_16_rows_on_a_capable_gpu_only(monkeypatch):
    if not gdc.HAVE_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(gdc, "_capable", lambda index: True)
    assert gdc.launch(_on_gpu(1)) and gdc.kwargs(_on_gpu(1)) == {"PDL": True, "launch_pdl": True}
    assert gdc.launch(_on_gpu(2)) and gdc.launch(_on_gpu(16))  # measured faster at 16 rows (gdc's doc)
    assert not gdc.launch(_on_gpu(17)) and not gdc.launch(_on_gpu(512))  # prefill chunks: not measured
    assert not gdc.launch(torch.zeros(1, 64))  # CPU tensors
    monkeypatch.setattr(gdc, "ENABLED", False)
    assert not gdc.launch(_on_gpu(1))
    monkeypatch.setattr(gdc, "ENABLED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not gdc.launch(_on_gpu(1))  # the interpreter runs no inline PTX
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(gdc, "_capable", lambda index: False)  # before sm_90
    assert not gdc.launch(_on_gpu(1))
