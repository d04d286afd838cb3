"""`muser bench kvpack` end to end on the tiny fixture (one repetition): the receipt's gate and
byte accounting, not its timings (benchmarks are commands, not timed tests)."""

from __future__ import annotations

import json

from muser.cli import main


def test_bench_kvpack_receipt(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("MUSER_RECEIPTS", str(tmp_path))  # the optional plot goes here too
    argv = ["bench", "kvpack", "--model", str(tiny_gguf), "--lengths", "530", "--reps", "1", "--warmup", "0",
            "--gate-tokens", "2", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    (receipt,) = tmp_path.glob("*-kvpack.json")
    r = json.loads(receipt.read_text())
    assert r["gate"]["status"] == "pass"
    g = r["gate"]["per_length"]["530"]
    assert g["restored"] == 512 and g["bitwise_first_logits"] and g["text_identical"]
    res = r["results"]["lengths"]["530"]
    assert res["kv_payload_bytes"] == res["formula_kv_bytes"] and res["stored_prefix_tokens"] == 512
    assert 0 < res["overhead_bytes"] < 16384
    assert set(r["cells"]) == {"cold/530", "warm/530"}
