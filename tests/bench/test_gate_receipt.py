"""`muser bench decode|prefill|verify --gate-receipt`: a run gated by a reduced-depth Gate 2
receipt (tools/device_gate_wide.py, here at the tiny widths on the CPU) reads n/a gated_by that
receipt, and a receipt that does not describe the timed model is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muser.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("wide")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, str(REPO / "tools" / "device_gate_wide.py"), str(d), "--device", "cpu",
                    "--geometry", "tiny", "--kv", "f32", "--gate-tokens", "4", "--workdir", str(d)],
                   check=True, env=env, capture_output=True)
    (receipt,) = d.glob("*-engine-gate2-wide-cpu.json")
    (fixture,) = d.glob("wide-4l-tiny-q4_k_xl.gguf")
    return receipt, fixture


def bench(model, receipt, out, *extra) -> int:
    return main(["bench", "decode", "--model", str(model), "--depths", "0", "--tokens", "2", "--reps", "1",
                 "--warmup", "0", "--kv", "f32", "--gate-receipt", str(receipt), "--out-dir", str(out), *extra])


def test_gated_by_receipt(wide, tmp_path):
    receipt, fixture = wide
    assert bench(fixture, receipt, tmp_path) == 0
    (r,) = [json.loads(p.read_text()) for p in tmp_path.glob("*-decode.json")]
    g = r["gate"]
    assert g["status"] == "n/a" and g["gated_by"] == receipt.name and g["gated_by_status"] == "pass"
    assert g["gated_by_row"]["kv"] == "f32" and g["gated_by_row"]["max_dlsm"] <= g["gated_by_row"]["bound"]
    assert r["results"]["status"] == "result"
    assert "--gate-receipt" in r["command"]


@pytest.mark.parametrize("case,needle", [
    ("dtypes", "gated dtypes"),
    ("kv", "no Gate 2 row for KV type 'f16'"),
    ("lane", "gated lane 'exact', this run is lane 'fast'"),
    ("edited", "not a receipt of the writer"),
    ("missing", "is not a file"),
])
def test_receipt_not_describing_the_model_is_refused(wide, tiny_gguf, tmp_path, capsys, case, needle):
    receipt, fixture = wide
    model, extra = fixture, []
    if case == "dtypes":
        model = tiny_gguf  # same widths, F32 weights: the receipt gated the Q4_K mix
    elif case == "kv":
        extra = ["--kv", "f16"]
    elif case == "lane":
        extra = ["--lane", "fast"]  # an exact-lane gate never gates the integer lane
    elif case == "edited":
        body = json.loads(receipt.read_text())
        body["gate"]["rows"][0]["max_dlsm"] = 0.0
        receipt = tmp_path / receipt.name
        receipt.write_text(json.dumps(body, indent=2) + "\n")
    else:
        receipt = tmp_path / "absent.json"
    out = tmp_path / "out"
    assert bench(model, receipt, out, *extra) != 0
    err = capsys.readouterr().err
    assert needle in err, err
    assert not list(out.glob("*.json"))
