"""`muser bench decode|prefill|verify` on the CPU on the tiny fixture: receipts carry every field,
bad flags are refused in one line before any work, a failing gate marks the figures "not a
result", the byte model matches a hand count, and the pinned llama.cpp runs side by side."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from muser.bench import speed
from muser.cli import main
from muser.model.synth import SynthSpec

DEPTHS = "0,40"  # 40 > the tiny fixture's window of 32: the sliding rings wrap at depth
SMALL = {"decode": "3", "prefill": "24", "verify": "16"}


def receipts(d: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]


def run_kind(kind, model, out, *extra):
    return main(["bench", kind, "--model", str(model), "--depths", DEPTHS, "--tokens", SMALL[kind],
                 "--reps", "2", "--warmup", "1", "--gate-tokens", "8", "--out-dir", str(out), *extra])


def check_common(r: dict, kind: str, model: Path, lane: str) -> None:
    assert r["kind"] == kind
    assert r["command"][:3] == ["muser", "bench", kind] and str(model) in r["command"]
    assert r["git_sha"] and r["git_sha"] != "unknown"
    assert r["model"]["path"] == str(model)
    assert len(r["model"]["identity"]["artifact_sha256"]) == 64
    assert r["model"]["weight_bytes_per_token"] > 0
    assert r["device"]["kind"] == "cpu" and r["device"]["threads"] >= 1
    assert r["lane"] == lane
    g = r["gate"]
    assert g["status"] == "pass" and g["greedy_tokens"] == 8 and g["max_dlsm"] <= g["bound"]
    assert r["results"]["status"] == "result"
    assert r["results"]["depths"] == [0, 40]
    for c in r["cells"].values():
        assert len(c["samples_s"]) == 2 and len(c["warmup_s"]) == 1
        assert all(s > 0 for s in c["samples_s"])


@pytest.mark.parametrize("kind,lane", [("decode", "exact"), ("prefill", "fast"), ("verify", "exact")])
def test_kind_writes_receipt(kind, lane, tiny_gguf, tmp_path):
    plot = ["--plot", str(tmp_path / "speed.png")] if kind == "prefill" else []  # verify has no plot
    # the fast lane's gate (oracle ggml-cpu) on f32 K/V: with f16 K/V the oracle also rounds Q and
    # the softmax probabilities to f16 inside attention, which the engine's attention does not
    kv = ["--kv", "f32"] if lane == "fast" else []
    assert run_kind(kind, tiny_gguf, tmp_path, "--lane", lane, *kv, *plot) == 0
    (r,) = receipts(tmp_path)
    check_common(r, kind, tiny_gguf, lane)
    if plot:
        assert (tmp_path / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    n = int(SMALL[kind])
    for d in ("0", "40"):
        res = r["results"]["per_depth"][d]
        if kind == "verify":
            mu = res["muser"]
            v, one = r["cells"][f"muser verify d{d}"], r["cells"][f"muser decode1 d{d}"]
            assert mu["ratio_verify_over_decode1"] == pytest.approx(v["mean_s"] / one["mean_s"])
            assert mu["target"]["applies"] is False  # the 1.3x target is a CUDA target
            assert len(mu["ratio_per_rep"]) == 2
        else:
            st = res["muser"]["tok_s"]
            cell = r["cells"][f"muser d{d}"]
            assert st["samples"] == pytest.approx([n / s for s in cell["samples_s"]])
            assert st["mean"] == pytest.approx(statistics.fmean(st["samples"]))
            assert st["cv"] == pytest.approx(statistics.stdev(st["samples"]) / st["mean"])
    if kind == "decode":
        b0, b40 = (r["results"]["per_depth"][d]["bytes_per_token"] for d in ("0", "40"))
        assert b0["weights"] == b40["weights"] == r["model"]["weight_bytes_per_token"]
        assert b40["kv_read_mean"] > b0["kv_read_mean"]
        st = r["results"]["per_depth"]["40"]["muser"]["tok_s"]
        assert st["achieved_gbps"]["samples"] == pytest.approx([b40["total"] * x / 1e9 for x in st["samples"]])
        for d in ("0", "40"):  # the end-to-end generate loop beside the engine's decode
            res = r["results"]["per_depth"][d]
            g = r["cells"][f"muser generate d{d}"]
            assert res["muser_generate"]["tok_s"]["samples"] == pytest.approx([n / s for s in g["samples_s"]])
            assert res["ratio_generate_over_decode"] == pytest.approx(
                res["muser_generate"]["tok_s"]["mean"] / res["muser"]["tok_s"]["mean"])
        # a new request's TTFT for a 16-token prompt, once (at the first depth)
        tt = r["results"]["per_depth"]["0"]["muser_ttft"]
        cell = r["cells"]["muser ttft16"]
        assert tt["prompt_tokens"] == 16 and tt["seconds"]["samples"] == pytest.approx(cell["samples_s"])
        assert tt["target"]["applies"] is False  # a CUDA target
        assert "muser_ttft" not in r["results"]["per_depth"]["40"]
    if lane == "fast":
        assert r["gate"]["lane_gated"] == "fast"
        assert r["gate"]["fast_lane_drift"]["argmax_agreement"] > 0.9


def test_kv_bytes_read_hand_count(tiny_gguf):
    from muser.model.loader import open_model

    mf = open_model(tiny_gguf)
    cfg = mf.config
    mf.close()
    spec = SynthSpec()  # 3 sliding layers (window 32) + 1 full NoPE layer, 2 KV heads x 32
    assert (cfg.n_swa, cfg.n_full, cfg.sliding_window) == (3, 1, spec.sliding_window)
    row = spec.n_kv_heads * spec.head_dim * 2 * 2  # K and V, f16, one position of one layer

    def hand(depth, n):  # position p reads p + 1 rows, at most the window on sliding layers
        return sum((3 * min(p + 1, spec.sliding_window) + (p + 1)) * row for p in range(depth, depth + n))

    for depth, n in ((0, 1), (0, 40), (31, 3), (100, 7)):
        assert speed.kv_bytes_read(cfg, depth, n, "f16") == hand(depth, n)
        assert speed.kv_bytes_read(cfg, depth, n, "f32") == 2 * hand(depth, n)


@pytest.mark.parametrize("argv,needle", [
    (["decode", "--lane", "turbo"], "unknown lane 'turbo'"),
    (["decode", "--depths", "4096"], "depth 4096 is >= the model's context_length 4096"),
    (["prefill", "--depths", "4000", "--tokens", "512"], "runs past the model's context_length 4096"),
    (["verify", "--tokens", "17"], "1..16 rows"),
    (["decode", "--depths", "0,x"], "is not an integer"),
    (["decode", "--device", "tpu"], "unknown device 'tpu'"),
    (["decode", "--against", "vllm"], "--against 'vllm'"),
    (["decode", "--reps", "0"], "--reps must be >= 1"),
    (["prefill", "--llama-bench-json", "x.json"], "--llama-bench-json is read only with --device cuda"),
])
def test_bad_flags_refused_before_work(argv, needle, tiny_gguf, tmp_path, monkeypatch, capsys):
    import muser.api

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(muser.api, "load", no_load)
    kind, rest = argv[0], argv[1:]
    rc = main(["bench", kind, "--model", str(tiny_gguf), "--out-dir", str(tmp_path), *rest])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert err.startswith("muser: error:") and "\n" not in err and needle in err, err
    assert not list(tmp_path.glob("*.json"))


def test_failing_gate_marks_not_a_result(tiny_gguf, tmp_path, monkeypatch):
    def failing_gate(model, path, lane, kv, n_gen):
        return {"status": "fail", "name": "Gate 2", "max_dlsm": 1.0, "bound": 1e-4, "greedy_tokens": n_gen,
                "tokens_identical": False}

    monkeypatch.setattr(speed, "run_gate", failing_gate)
    rc = main(["bench", "decode", "--model", str(tiny_gguf), "--tokens", "2", "--reps", "1",
               "--out-dir", str(tmp_path)])
    assert rc == 1
    (r,) = receipts(tmp_path)
    assert r["gate"]["status"] == "fail"
    assert r["results"]["status"] == "not a result" and "gate failed" in r["results"]["reason"]


def test_interleaved_order():
    calls = []
    cells = speed.interleave({"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0},
                             reps=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert cells["a"].samples == [1.0] * 3 and cells["b"].warmup == [2.0]


def test_llama_bench_json_reading(tmp_path):
    rec = lambda p, g, d, name="m.gguf": {"model_filename": f"/x/{name}", "n_prompt": p, "n_gen": g,  # noqa: E731
                                          "n_depth": d, "samples_ns": [2_000_000_000, 4_000_000_000]}
    f = tmp_path / "lb.json"
    f.write_text(json.dumps([rec(512, 0, 0), rec(0, 128, 0), rec(0, 128, 8192)]))
    data = speed.load_bench_json(f)
    assert speed.pick_bench_samples(data, 0, 128, 8192, "/y/m.gguf") == [2.0, 4.0]
    from muser.errors import ComparatorError

    with pytest.raises(ComparatorError, match="n_depth 32768"):
        speed.pick_bench_samples(data, 0, 128, 32768, "/y/m.gguf")
    with pytest.raises(ComparatorError, match="measured 'm.gguf'"):
        speed.pick_bench_samples(data, 512, 0, 0, "/y/other.gguf")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ComparatorError, match="not a list"):
        speed.load_bench_json(tmp_path / "bad.json")


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_against_llamacpp_cpu(kind, tiny_gguf, tmp_path):
    assert run_kind(kind, tiny_gguf, tmp_path, "--against", "llama.cpp", "--threads", "1") == 0
    (r,) = receipts(tmp_path)
    check_common(r, kind, tiny_gguf, "exact")
    comp = r["comparator"]
    assert comp["interleaved"] is True and comp["n_threads"] == 1 and comp["n_ubatch"] == 512
    for d in ("0", "40"):
        res = r["results"]["per_depth"][d]
        if kind == "decode":
            ll = res["llama.cpp"]["tok_s"]
            assert len(ll["samples"]) == 2 and ll["mean"] > 0
            assert res["ratio_muser_over_llamacpp"] == pytest.approx(res["muser"]["tok_s"]["mean"] / ll["mean"])
        else:
            ll = res["llama.cpp"]
            assert ll["ratio_verify_over_decode1"] > 0
            assert res["speed_ratio_verify"] == pytest.approx(ll["verify_s"]["mean"] / res["muser"]["verify_s"]["mean"])


def test_cuda_comparator_inputs_come_from_the_command_line(tmp_path):
    """The CUDA llama-bench comparator never looks for its script or tarball in the checkout or
    beside it: each is a named argument, refused by name when missing or not a file."""
    from muser.bench.speed import LlamaBenchCuda
    from muser.errors import ComparatorError

    with pytest.raises(ComparatorError, match="--llama-bench-script"):
        LlamaBenchCuda(tmp_path / "m.gguf", "f16", None, None)
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\n")
    with pytest.raises(ComparatorError, match="--llama-tarball"):
        LlamaBenchCuda(tmp_path / "m.gguf", "f16", None, str(script))
    with pytest.raises(ComparatorError, match="is not a file"):
        LlamaBenchCuda(tmp_path / "m.gguf", "f16", str(tmp_path / "missing.tgz"), str(script))
