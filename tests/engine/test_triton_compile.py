"""Every Triton kernel the engine launches compiles for the H200 (sm_90) down to a cubin, on
this CPU machine: tools/triton_aot_check.py drives the real host code, records each launch and
compiles it with Triton's bundled ptxas. The interpreter the other engine tests use cannot see
compile-time errors (an if/else that gives one variable two integer widths, for one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")


@pytest.mark.timeout(900)
def test_every_engine_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "aot.json"
    p = subprocess.run([sys.executable, str(REPO / "tools" / "triton_aot_check.py"), "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=880)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = json.loads(out.read_text())
    kernels = {r["kernel"] for r in rows}
    # the engine's kernels are all there: attention (partial + reduce), GEMM (+ its prep), dequant
    assert {"_attn_partial", "_attn_reduce", "_qgemm_kernel", "_prep_kernel", "_chunk_sum", "_attn_rows", "_dequant_kernel", "_matvec_nvfp4_kernel", "_dequant_nvfp4_kernel", "_norm_mul_kernel", "_norm2_kernel", "_qk_norm_rope_kernel",
            "_gate_kernel"} <= kernels
    assert all(r["ok"] for r in rows)
