"""`muser bench kvpack` end to end on the tiny fixture (one repetition): the receipt's gate and
byte accounting, not its timings (benchmarks are commands, not timed tests)."""

from __future__ import annotations

import json

from muser.bench.plot import PNG_MAGIC
from muser.cli import main


def test_bench_kvpack_receipt(tiny_gguf, tmp_path):
    argv = ["bench", "kvpack", "--model", str(tiny_gguf), "--lengths", "530", "--reps", "1", "--warmup", "0",
            "--gate-tokens", "2", "--out-dir", str(tmp_path), "--plot"]
    assert main(argv) == 0
    (receipt,) = tmp_path.glob("*-kvpack.json")
    assert receipt.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC  # bare --plot: next to the receipt
    r = json.loads(receipt.read_text())
    assert r["gate"]["status"] == "pass"
    g = r["gate"]["per_length"]["530"]
    assert g["restored"] == 512 and g["bitwise_first_logits"] and g["text_identical"]
    res = r["results"]["lengths"]["530"]
    assert res["kv_payload_bytes"] == res["formula_kv_bytes"] and res["stored_prefix_tokens"] == 512
    assert 0 < res["overhead_bytes"] < 16384
    # bytes on disk are the byte format's: headers + manifests + tiles, to the byte
    assert res["disk_equals_formula"] and res["bytes_on_disk"] == res["disk_formula"]["bytes"]
    assert r["gate"]["bytes"]["530"] == {"payload_equals_formula": True, "disk_equals_formula": True}
    disk = r["results"]["disk_read"]
    assert disk["bytes"] >= 16 << 20 and len(disk["bytes_per_s"]) == 3
    for mode in ("cold", "warm"):
        t = res[f"restore_{mode}"]
        assert len(t["restore_s"]) == 5 and t["restore_vs_disk_read"] > 0
    assert len(res["restore_cold"]["resident_after_drop"]) == 5
    assert set(r["cells"]) == {"cold/530", "warm/530"}
