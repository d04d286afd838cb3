"""`muser bench parity` and `muser bench oracle` write receipts; bad input is one line, exit 2."""

from __future__ import annotations

import json

from muser.cli import main


def _receipt(out_dir, kind):
    files = sorted(out_dir.glob(f"*-{kind}*.json"))
    assert files, f"no {kind} receipt in {out_dir}"
    return json.loads(files[-1].read_text())


def test_parity_cli_gate_1a_receipt(semantic_gguf, tmp_path, capsys):
    rc = main(["bench", "parity", "--model", str(semantic_gguf), "--kv", "f32", "--n-tokens", "40",
               "--runs", "prefill,decode,33", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "Gate 1a: pass" in out
    r = _receipt(tmp_path, "parity")
    assert r["gate"]["status"] == "pass" and r["gate"]["name"] == "Gate 1a"
    s = r["results"]["summary"]
    assert s["arithmetic"] == "f32" and s["kv"] == "f32" and s["positions"] == 120
    assert s["max"] <= max(1e-4, 2 * s["noise_floor"]) and s["top1_agreement"] == 1.0
    assert r["comparator"]["type_k"] == 0 and r["comparator"]["flash_attn"] is False
    assert len(r["tokens"]) == 40 and [x["label"] for x in r["results"]["runs"]] == [
        "prefill[40]", "decode[40]", "prefill33+decode[40]"]


def test_parity_cli_refuses_bad_tokens(semantic_gguf, tmp_path, capsys):
    rc = main(["bench", "parity", "--model", str(semantic_gguf), "--tokens", "1,2,99999",
               "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "token id 99999" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("*.json"))
    rc = main(["bench", "parity", "--model", str(semantic_gguf), "--tokens", "1,x", "--out-dir", str(tmp_path)])
    assert rc == 2


def test_oracle_bench_cli(semantic_gguf, tmp_path, capsys):
    rc = main(["bench", "oracle", "--model", str(semantic_gguf), "--prefill", "40", "--decode", "3",
               "--arithmetic", "f32", "--reps", "2", "--warmup", "0", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "tok/s" in out
    r = _receipt(tmp_path, "oracle")
    assert r["gate"]["status"] == "pass" and r["gate"]["parity"]["f32"]["gate"] == "1a"
    assert set(r["results"]) == {"prefill40/f32", "decode3/f32"}
    assert len(r["cells"]["prefill40/f32"]["samples_s"]) == 2
