"""tools/device_session.sh: the script parses, refuses an unknown stage before any work, and its
CPU dry run of the fixture stage brings back the bundle the GPU call returns (stage table,
receipts and logs archives, summary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "device_session.sh"


def run(tmp_path, *args):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable, MUSER_DEVICE_WORK=str(tmp_path / "work"))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_unknown_stage_refused(tmp_path):
    p = run(tmp_path, "--cpu-dry", "fixture", "benchmark")
    assert p.returncode == 2 and "unknown argument or stage: benchmark" in p.stderr
    assert not (tmp_path / "work").exists()


def test_cpu_dry_fixture_stage_bundles_what_comes_back(tmp_path):
    p = run(tmp_path, "--cpu-dry", "build", "fixture")
    assert p.returncode == 0, p.stdout + p.stderr
    out = tmp_path / "out"
    assert sorted(x.name for x in out.iterdir()) == ["logs.tgz", "receipts.tgz", "stages.tsv", "summary.txt"]
    rows = [r.split("\t") for r in (out / "stages.tsv").read_text().splitlines()]
    assert rows[0] == ["stage", "rc", "seconds", "note"] and rows[1][0] == "build" and "dry run" in rows[1][3]
    with tarfile.open(out / "logs.tgz") as t:
        assert "logs/build_ext.log" in t.getnames()
    work = tmp_path / "work"
    assert (work / "full.done").read_text().startswith("rc=0") and (work / "dry-q4_k_xl.gguf").stat().st_size > 0
    # the NVFP4 file is written only for the stage that reads it
    assert not (work / "nv.done").exists() and not (work / "dry-nvfp4-ggml.gguf").exists()


def test_an_unknown_attention_sweep_is_refused_before_any_work(tmp_path):
    p = run(tmp_path, "--cpu-dry", "--attn-sweeps", "exact,wide", "attn")
    assert p.returncode == 2 and "--attn-sweeps exact,wide: expected" in p.stderr
    assert not (tmp_path / "work").exists()


def test_no_attention_sweep_is_accepted_alone_only(tmp_path):
    p = run(tmp_path, "--cpu-dry", "--attn-sweeps", "none,exact", "attn")
    assert p.returncode == 2 and "--attn-sweeps none,exact: expected" in p.stderr
    # "none" alone parses: the run goes on to the next argument (an unknown stage, refused)
    p = run(tmp_path, "--cpu-dry", "--attn-sweeps", "none", "benchmark")
    assert p.returncode == 2 and "unknown argument or stage: benchmark" in p.stderr
    assert not (tmp_path / "work").exists()


def test_an_abbreviated_sha_is_refused_before_any_work(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable, MUSER_DEVICE_WORK=str(tmp_path / "work"),
               MUSER_GIT_SHA="1319bb1")
    p = subprocess.run(["bash", str(SCRIPT), "--cpu-dry", "fixture"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "MUSER_GIT_SHA '1319bb1' is not a full 40-hex SHA" in p.stderr
    assert not (tmp_path / "work").exists()


def test_reuse_gates_takes_an_earlier_calls_gate_of_this_tree_only(tmp_path):
    """--reuse-gates: a wide Gate 2 receipt an earlier call left on the machine gates this call when it
    names this tree's SHA, the mix and the lane (it comes back in this call's receipts); another tree's,
    or another lane's, is not used."""
    import json

    sha, other = "a" * 40, "b" * 40
    prev = tmp_path / "work" / "out" / "receipts"
    prev.mkdir(parents=True)
    (prev / "20260101T000000Z-engine-gate2-wide-cpu.json").write_text(json.dumps(
        {"kind": "engine-gate2-wide-cpu", "git_sha": sha, "model": {"dtype": "q4_k_xl"}, "lane": "exact"}, indent=2))
    for tree, lane, reused in ((sha, "exact", True), (other, "exact", False), (sha, "fast", False)):
        env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable, MUSER_DEVICE_WORK=str(tmp_path / "work"),
                   MUSER_GIT_SHA=tree)
        p = subprocess.run(["bash", str(SCRIPT), "--cpu-dry", "--deadline", "70", "--reuse-gates", "--lane", lane,
                            "gate"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        rows = [r.split("\t") for r in (tmp_path / "out" / "stages.tsv").read_text().splitlines()]
        gate = [r for r in rows if r[0] == "gate-q4_k_xl"]
        assert gate and (gate[0][3].startswith("reused 20260101T000000Z-engine-gate2-wide-cpu.json") == reused), rows
        with tarfile.open(tmp_path / "out" / "receipts.tgz") as t:
            names = t.getnames()
        assert ("receipts/20260101T000000Z-engine-gate2-wide-cpu.json" in names) == reused, names


def test_reuse_gates_takes_a_carried_gate_on_a_bare_machine(tmp_path):
    """--reuse-gates on a machine with no earlier call: a receipt of this tree and lane in the carry's
    gates/ folder gates the call (another lane's there is not used)."""
    import json

    sha = "c" * 40
    gates = tmp_path / "carry" / "gates"
    gates.mkdir(parents=True)
    (gates / "20260101T000001Z-engine-gate2-wide-cpu.json").write_text(json.dumps(
        {"kind": "engine-gate2-wide-cpu", "git_sha": sha, "model": {"dtype": "q4_k_xl"}, "lane": "fast"}, indent=2))
    for lane, reused in (("fast", True), ("exact", False)):
        env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable, MUSER_DEVICE_WORK=str(tmp_path / "work"),
                   MUSER_GIT_SHA=sha)
        p = subprocess.run(["bash", str(SCRIPT), "--cpu-dry", "--deadline", "70", "--carry", str(tmp_path / "carry"),
                            "--reuse-gates", "--lane", lane, "gate"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        rows = [r.split("\t") for r in (tmp_path / "out" / "stages.tsv").read_text().splitlines()]
        gate = [r for r in rows if r[0] == "gate-q4_k_xl"]
        assert gate and gate[0][3].startswith("reused 20260101T000001Z-engine-gate2-wide-cpu.json") == reused, rows


def test_the_speed_stage_writes_the_file_it_reads(tmp_path):
    """A bare machine asked for speed (fixture not named) writes the full file first."""
    p = run(tmp_path, "--cpu-dry", "--deadline", "70", "--gates-only", "speed")
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "work" / "full.done").read_text().startswith("rc=0")
    assert (tmp_path / "work" / "dry-q4_k_xl.gguf").stat().st_size > 0


def test_gates_only_records_the_speed_stage_without_running_it(tmp_path):
    p = run(tmp_path, "--cpu-dry", "--deadline", "70", "--gates-only", "gate", "speed")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [r.split("\t") for r in (tmp_path / "out" / "stages.tsv").read_text().splitlines()]
    assert ["speed", "-", "0", "--gates-only: the file and the wide Gate 2 only"] in rows, rows
    assert not list((tmp_path / "work" / "out" / "receipts").glob("*-decode.json"))


def test_cpu_dry_nvfp4_fixture_is_the_q4_k_file_quantized(tmp_path):
    """With the nvfp4 stage named, the fixture stage writes the Q4_K file, then its NVFP4 form by
    `muser quantize` (nv.done carries the quantize time); a deadline too short for the gate
    skips the stages themselves, and the script waits for the fixture writers."""
    from muser.gguf.reader import read_gguf
    from muser.model.loader import open_model

    p = run(tmp_path, "--cpu-dry", "--deadline", "60", "fixture", "nvfp4")
    assert p.returncode == 0, p.stdout + p.stderr
    work = tmp_path / "work"
    done = (work / "nv.done").read_text()
    assert done.startswith("rc=0 ") and done.rstrip().endswith("(muser quantize --to nvfp4-ggml)"), done
    with tarfile.open(tmp_path / "out" / "logs.tgz") as t:
        log = t.extractfile("logs/fixture-nvfp4-ggml.log").read().decode()
    assert "Q4_K -> NVFP4" in log and "wrote " in log
    m = open_model(work / "dry-nvfp4-ggml.gguf")
    m.close()
    with read_gguf(work / "dry-q4_k_xl.gguf") as q4, read_gguf(work / "dry-nvfp4-ggml.gguf") as nv:
        assert q4.tensors["blk.0.ffn_up.weight"].type.ggml_type.name == "Q4_K"
        assert nv.tensors["blk.0.ffn_up.weight"].type.ggml_type.name == "NVFP4"
        assert nv.get_str("muser.weight_precision") == "nvfp4-ggml"


def test_an_unknown_kernels_lane_is_refused_before_any_work(tmp_path):
    p = run(tmp_path, "--cpu-dry", "--kernels-lane", "turbo", "kernels")
    assert p.returncode == 2 and "--kernels-lane turbo" in p.stderr
    assert not (tmp_path / "work").exists()


def test_the_tuning_table_takes_the_fastest_tiling_with_the_default_bits():
    """tools/device_kernels.py's sweep -> v3_tuning.json entries: per shape and row bucket the
    fastest config among those whose outputs were bitwise the default tiling's; a faster config
    with other bits, or one that failed, is never taken."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import device_kernels
    finally:
        sys.path.pop(0)
    speed = [{"fmt": "Q4_K", "n_out": 64, "n_in": 512,
              "T1_sweep": {"[8, 4, 0]": {"us": 9.0, "bitwise_equal_default": True},
                           "[16, 4, 3]": {"us": 7.5, "bitwise_equal_default": True},
                           "[32, 4, 0]": {"us": 5.0, "bitwise_equal_default": False},
                           "[64, 8, 0]": {"error": "OutOfResources"}},
              "T16_sweep": {"[8, 8, 0]": {"us": 40.0, "bitwise_equal_default": True},
                            "[8, 4, 0, 4]": {"us": 30.0, "bitwise_equal_default": True},
                            "[16, 4, 0, 4]": {"us": 20.0, "bitwise_equal_default": False}}},
             {"fmt": "Q6_K", "n_out": 64, "n_in": 512, "error": "boom"}]
    table = device_kernels.tuning_table(speed)
    assert table == [{"fmt": "Q4_K", "rows": 1, "n_out": 64, "n_in": 512, "config": [16, 4, 3], "us": 7.5},
                     {"fmt": "Q4_K", "rows": 16, "n_out": 64, "n_in": 512, "config": [8, 4, 0, 4], "us": 30.0}]


def test_the_int8_table_takes_the_fastest_route_with_the_references_bits(tmp_path, monkeypatch):
    """tools/device_kernels.py --lane fast's sweep -> i8_tuning.json: per shape and row bucket the
    fastest of the tile's default and its tilings (a one-row walk as split false), among those with
    the default's bits and more than the margin faster; the table loads (qtile_i8.load_tuning) and
    routes those calls; a bad entry (a retired "wide" path included) is refused with nothing taken."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import device_kernels
    finally:
        sys.path.pop(0)
    from muser.engine.kernels import qtile_i8
    from muser.engine.weights import random_bytes, repack
    from muser.errors import LaneError
    from muser.gguf.types import GgmlType as G

    d1, d16, d64 = (list(qtile_i8.config_for(t)) for t in (1, 16, 512))
    tile = {"bitwise_vs_reference": {"T1": True, "T16": True, "T512": True},
            "T1": {"us": 10.0}, "T16": {"us": 20.0}, "T64": {"us": 50.0}, "T512": {"us": 100.0},
            "sweep": {"T1 [64, 8, 4, 1]": {"us": 9.9, "bitwise_equal_default": True},  # inside the margin
                      "T1 [32, 8, 2, 0]": {"us": 5.0, "bitwise_equal_default": False},
                      "T1 [64, 8, 4, 0] walk": {"us": 8.0, "bitwise_equal_default": True},
                      "T16 [64, 16, 4, 1]": {"us": 15.0, "bitwise_equal_default": True},
                      "T16 [64, 16, 4, 4] ring": {"us": 16.0, "bitwise_equal_default": True},
                      "T16 [64, 16, 4, 4] ring g4": {"us": 14.0, "bitwise_equal_default": True},
                      "T16 [32, 16, 2, 4] ring g2": {"us": 11.0, "bitwise_equal_default": False},
                      "T16 [64, 16, 4, 6] ring walk": {"us": 12.0, "bitwise_equal_default": False},
                      "T16 [32, 16, 2, 3] ring walk sk6": {"us": 13.0, "bitwise_equal_default": False},
                      "T512 [64, 16, 4, 1]": {"us": 90.0, "bitwise_equal_default": True},
                      "T1 [32, 8, 2, 4] ring walk": {"us": 7.0, "bitwise_equal_default": True},
                      "T512 [128, 16, 4, 1]": {"us": 40.0, "bitwise_equal_default": False},
                      "T512 [256, 16, 8, 0]": {"error": "OutOfResources"}}}
    speed = [{"fmt": "Q4_K", "n_out": 64, "n_in": 512, "tile": tile},
             {"fmt": "Q6_K", "n_out": 64, "n_in": 512, "tile": {**tile, "sweep": {}}},
             {"fmt": "Q5_K", "n_out": 64, "n_in": 512, "tile": {"error": "boom"}},
             {"fmt": "Q5_K", "n_out": 32, "n_in": 512,  # a tiling inside the margin: the default stays
              "tile": {**tile, "sweep": {"T512 [64, 16, 4, 1]": {"us": 98.0, "bitwise_equal_default": True}}}},
             {"fmt": "Q6_K", "n_out": 32, "n_in": 512, "tile": {**tile, "bitwise_vs_reference": {"T1": False}}}]
    table = device_kernels.i8_tuning_table(speed)
    key = {"fmt": "Q4_K", "n_out": 64, "n_in": 512}
    assert table[:3] == [{**key, "rows": 8, "path": "ring", "config": [32, 8, 2, 4], "split": False, "us": 7.0,
                          "default_us": 10.0},
                         {**key, "rows": 16, "path": "ring", "config": [64, 16, 4, 4], "group": 4, "us": 14.0,
                          "default_us": 20.0},
                         {**key, "rows": 64, "path": "tile", "config": [64, 16, 4, 1], "us": 90.0, "default_us": 100.0}]
    assert [(e["fmt"], e["n_out"], e["rows"], e["path"], e["config"]) for e in table[3:]] == [
        ("Q6_K", 64, 8, "tile", d1), ("Q6_K", 64, 16, "tile", d16), ("Q6_K", 64, 64, "tile", d64),
        ("Q5_K", 32, 8, "tile", d1), ("Q5_K", 32, 16, "tile", d16), ("Q5_K", 32, 64, "tile", d64)]
    path = tmp_path / "i8_tuning.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(qtile_i8, "TUNED", {})
    assert qtile_i8.load_tuning(str(path)) == 9
    loaded = dict(qtile_i8.TUNED)
    w = repack("t", G.Q4_K, 64, 512, torch.from_numpy(random_bytes(G.Q4_K, 64, 512, 1).copy()))
    assert qtile_i8.route(w, 1) == ("ring", (32, 8, 2, 4), False, 1, 0)
    assert qtile_i8.ring_routes() == [("Q4_K", (32, 8, 2, 4), False, 1, 0), ("Q4_K", (64, 16, 4, 4), None, 4, 0)]
    assert qtile_i8.route(w, 12) == ("ring", (64, 16, 4, 4), None, 4, 0)
    assert qtile_i8.route(w, 17) == ("tile", (64, 16, 4, 1), None, 1, 0)
    other = repack("t", G.Q4_K, 32, 512, torch.from_numpy(random_bytes(G.Q4_K, 32, 512, 1).copy()))
    assert qtile_i8.route(other, 1) == ("tile", None, None, 1, 0)
    for bad, what in [({"path": "wide"}, "path 'wide'"),
                      ({"rows": 64, "split": True}, "split"), ({"config": [48, 8, 4, 0]}, "config"), ({"path": "ring", "config": [64, 16, 4, 5]}, "ring config"),
                      ({"fmt": "Q8_0"}, "K-quant"), ({"rows": 32}, "rows 8, 16 or 64"), ({"path": "cublas"}, "path"),
                      ({"path": "ring", "rows": 64, "split": True}, "split"),
                      ({"path": "ring", "config": [64, 16, 4, 4], "rows": 16, "split": False, "group": 2}, "group 2"),
                      ({"path": "ring", "config": [64, 16, 4, 4], "rows": 64, "group": 2}, "group 2"),
                      ({"path": "ring", "config": [64, 16, 4, 4], "rows": 16, "group": 0}, "group 0"),
                      ({"path": "ring", "config": [64, 16, 4, 4], "rows": 16, "group": 17}, "group 17"),
                      ({"path": "ring", "config": [64, 16, 4, 4], "rows": 16, "group": True}, "group True"),
                      ({"path": "ring", "config": [64, 16, 4, 4], "rows": 16, "stream": 3}, "stream 3"),
                      ({"path": "ring", "config": [64, 8, 4, 4], "rows": 16, "split": False, "stream": 3}, "stream 3"),
                      ({"path": "ring", "config": [64, 16, 4, 4], "rows": 16, "split": False, "stream": 9}, "stream 9"),
                      ({"path": "ring", "config": [64, 16, 4, 4], "rows": 16, "split": False, "stream": True},
                       "stream True")]:
        entry = {**table[0], "rows": 64, "split": None, **bad}
        path.write_text(json.dumps([table[1], {k: v for k, v in entry.items() if v is not None}]))
        with pytest.raises(LaneError, match=what):
            qtile_i8.load_tuning(str(path))
    assert qtile_i8.TUNED == loaded  # all or nothing: the refused files took no entry


def test_the_decode_kind_has_a_box_for_each_depth(tmp_path):
    """Decode runs once a depth of --depths (a deep one prefills its context first), each run with
    its own --kind-box and receipt, so a deadline that cuts the deep run keeps the shallower
    receipt (the dry run's depths are 0 and 40; the carried gate here is a stub the bench refuses,
    so only the boxes are checked). Verify runs with the comparator at the first depth in one box
    and alone at the deeper ones in a box of their own."""
    sha = "d" * 40
    gates = tmp_path / "carry" / "gates"
    gates.mkdir(parents=True)
    (gates / "20260101T000002Z-engine-gate2-wide-cpu.json").write_text(json.dumps(
        {"kind": "engine-gate2-wide-cpu", "git_sha": sha, "model": {"dtype": "q4_k_xl"}, "lane": "exact"}, indent=2))
    env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable, MUSER_DEVICE_WORK=str(tmp_path / "work"),
               MUSER_GIT_SHA=sha)
    p = subprocess.run(["bash", str(SCRIPT), "--cpu-dry", "--deadline", "200", "--carry", str(tmp_path / "carry"),
                        "--reuse-gates", "--kind-box", "45", "--kinds", "decode,verify",
                        "gate", "speed"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    table = [r.split("\t") for r in (tmp_path / "out" / "stages.tsv").read_text().splitlines()]
    decode = [r for r in table if r[0] == "speed-decode"]
    assert len(decode) == 2 and all(r[3].startswith("box 45 s") for r in decode), table
    rows = {r[0]: r for r in table}
    assert rows["speed-verify"][3].startswith("box 45 s"), rows
    assert rows["speed-verify-deep"][3].startswith("box 45 s"), rows


def test_the_waves_probe_times_whole_waves_of_the_weights_rows(monkeypatch):
    """tools/device_kernels.py's waves probe: the walked ring on the weight's first k x SMs x BN
    rows (k = 1, 2, 3) and on all of them, each a row slice of the same fields (the call's own
    bytes); a weight of fewer than two waves of tiles is not probed. The kernel and the timer are
    replaced here (gluon has no interpreter)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "tools"))
    try:
        import device_kernels
    finally:
        sys.path.pop(0)
    from muser.engine.kernels import qmatmul_i8, qtile_i8
    from muser.engine.weights import random_bytes, repack
    from muser.gguf.types import GgmlType as G

    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=2))
    monkeypatch.setattr(qtile_i8, "matmul_ring", lambda w, act, out, config, split: calls.append(
        (w.n_out, tuple(w.fields["qs"].shape), w.fields["qs"].data_ptr(), config, split, tuple(out.shape))))
    monkeypatch.setattr(device_kernels, "graph_seconds", lambda fn, launches, reps: fn() or [2e-6, 1e-6, 3e-6])
    w = repack("t", G.Q4_K, 400, 512, torch.from_numpy(random_bytes(G.Q4_K, 400, 512, 1).copy()))
    act = qmatmul_i8.Act(G.Q8_K, torch.zeros(16, 512, dtype=torch.int8), torch.zeros(16, 2),
                         torch.zeros(16, 16, dtype=torch.int32))
    res = device_kernels.waves_probe(w, act, "cpu")
    assert [k for k in res if k.startswith("N")] == ["N128", "N256", "N384", "N400"]
    assert [res[k]["tiles"] for k in ("N128", "N256", "N384", "N400")] == [2, 4, 6, 7]
    assert res["N128"]["us"] == 1.0 and res["N128"]["GBps"] == pytest.approx(
        sum(v[:128].numel() * v.element_size() for v in w.fields.values()) / 1e3)
    assert [c[0] for c in calls] == [128, 256, 384, 400]
    assert all(c[1] == (c[0], 256) and c[2] == w.fields["qs"].data_ptr() for c in calls)  # slices, not copies
    assert all(c[3] == (64, 16, 4, 4) and c[4] is False and c[5] == (16, c[0]) for c in calls)
    small = repack("t", G.Q4_K, 200, 512, torch.from_numpy(random_bytes(G.Q4_K, 200, 512, 1).copy()))
    assert device_kernels.waves_probe(small, act, "cpu") == {}
