"""`muser inspect`: human and JSON output, numbers consistent with the file."""

from __future__ import annotations

import json
import subprocess
import sys

from muser.cli import main
from muser.model.synth import SynthSpec


def test_inspect_json(make_gguf, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MUSER_CACHE", str(tmp_path))
    p = make_gguf(SynthSpec(dtype="q4_k_xl", source="blocks"))
    assert main(["inspect", str(p), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "valid"
    assert d["parameters"] == 5_382_912
    assert d["config"]["collar"] == "SSSF x 1"
    assert set(d["dtype_mix"]) == {"F32", "Q4_K", "Q5_K", "Q6_K"}
    assert sum(e["bytes"] for e in d["dtype_mix"].values()) == sum(d["bytes_by_class"].values())
    # one embedding row instead of the whole table
    row = 512 // 256 * 144
    assert d["weight_bytes_per_token"] == sum(d["bytes_by_class"].values()) - d["bytes_by_class"]["embedding"] + row
    assert d["kv"]["131072"]["per_slot_bytes"] == (3 * 32 + 1 * 131072) * 2 * 32 * 2 * 2
    assert d["kv"]["131072"]["four_slots_bytes"] == 4 * d["kv"]["131072"]["per_slot_bytes"]
    assert len(d["identity"]["artifact_sha256"]) == 64


def test_inspect_human(tiny_gguf, tmp_path):
    r = subprocess.run([sys.executable, "-m", "muser", "inspect", str(tiny_gguf), "--no-hash"],
                       capture_output=True, text=True, env={"MUSER_CACHE": str(tmp_path), "PATH": ""})
    assert r.returncode == 0, r.stderr
    assert "parameters      5,382,912" in r.stdout
    assert "[SSSF x 1]" in r.stdout and "verdict         valid" in r.stdout


def test_help_lists_commands():
    r = subprocess.run([sys.executable, "-m", "muser", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "inspect" in r.stdout
