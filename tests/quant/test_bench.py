"""`muser bench quant` runs end to end on a tiny matrix and writes a passing receipt (the gate
compares the benchmarked bytes with the pinned ggml). Not a timing test."""

from __future__ import annotations

import json

from muser.cli import main


def test_bench_quant_smoke(tmp_path, capsys):
    rc = main(["bench", "quant", "--rows", "8", "--cols", "256", "--reps", "1", "--warmup", "0",
               "--out-dir", str(tmp_path)])
    assert rc == 0
    (receipt,) = tmp_path.glob("*-quant.json")
    body = json.loads(receipt.read_text())
    assert body["gate"]["status"] == "pass"
    fmts = body["results"]["formats"]
    assert set(fmts) == {"f16", "bf16", "q8_0", "q6_k", "q5_k", "q4_k", "q4_0", "nvfp4", "nvfp4-ggml"}
    assert all(v["quantize_MBps_per_core"] > 0 and v["dequantize_MBps_per_core"] > 0 for v in fmts.values())
    assert len(body["cells"]["quantize/q4_k"]["samples_s"]) == 1
    assert main(["bench", "quant", "--formats", "q9_9", "--out-dir", str(tmp_path)]) == 2
