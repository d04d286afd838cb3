"""Gate 2 on NVFP4 (DESIGN.md): the engine's exact lane against the oracle's f32 arithmetic on a
tiny F32 master quantized by `muser quantize`'s converter to both NVFP4 forms (Muser's companion
NVFP4_E2M1 + E4M3FN scales, ggml's type 40), with f32 K/V: 256 greedy tokens identical and
max |d log-softmax| <= max(1e-4, 2 x noise floor)."""

from __future__ import annotations

import pytest
import torch

import muser
import muser.oracle as oracle
from muser.engine import Engine
from muser.gates import gate2
from muser.gguf.types import GgmlType as G
from muser.model.synth import SynthSpec
from muser.quant.convert import convert


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def nvfp4_files(make_gguf, tmp_path_factory):
    master = make_gguf(SynthSpec(dtype="F32"))
    d = tmp_path_factory.mktemp("nvfp4")
    return {t: convert(master, d / f"{t}.gguf", t) for t in ("nvfp4", "nvfp4-ggml")}


@pytest.mark.parametrize("target", ["nvfp4", "nvfp4-ggml"])
def test_gate2_exact_lane_vs_oracle_nvfp4(nvfp4_files, target):
    path = nvfp4_files[target]
    eng = Engine.open(path, device="cpu", lane="exact", kv="f32")
    want = G.NVFP4_E2M1 if target == "nvfp4" else G.NVFP4
    assert eng.weights.layers[0].ffn_up.fmt == want  # the NVFP4 bytes are what is served
    r = gate2(path, eng, oracle.load(path, arithmetic="f32", kv="f32"), "f32", n_gen=256, noise="if_needed")
    assert r["status"] == "pass", r
    assert r["tokens_identical"], r
    assert r["max_dlsm"] <= max(1e-4, 2 * (r["noise_floor"] or 0.0))


def test_load_refuses_nan_scale_byte_naming_tensor_and_block(nvfp4_files, tmp_path):
    from muser.errors import FormatError
    from muser.gguf.reader import read_gguf

    src = nvfp4_files["nvfp4"]
    f = read_gguf(src)
    t = f.tensors["blk.1.ffn_down.weight.nvfp4_scale"]
    off, gpr = t.offset, t.shape[0]  # scale bytes [n_out, n_in/16], row-major
    f.close()
    bad = bytearray(src.read_bytes())
    bad[off + 2 * gpr + 1] = 0xFF  # row 2, block 1
    p = tmp_path / "nan.gguf"
    p.write_bytes(bytes(bad))
    with pytest.raises(FormatError, match=r"blk\.1\.ffn_down\.weight\.nvfp4_scale.*0xff.*row 2, group 1"):
        muser.load(p, device="cpu")


@pytest.mark.parametrize("target", ["nvfp4", "nvfp4-w4a4", "nvfp4-ggml"])
def test_cli_generate_on_nvfp4_file(make_gguf, tmp_path, capsys, target):
    import json

    from muser.cli import main
    from muser.generation import generate
    from muser.sample import SamplingParams

    path = convert(make_gguf(SynthSpec(dtype="F32")), tmp_path / f"{target}.gguf", target)
    rc = main(["generate", "--model", str(path), "--prompt", "Errors should never", "--max-tokens", "8",
               "--temperature", "0", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = json.loads(out.splitlines()[-1])
    m = muser.load(path, device="cpu")
    ids = m.tokenizer.encode("Errors should never", add_special=True)
    assert summary["prompt_ids"] == ids
    g = generate(m.session(max_context=len(ids) + 8), m.tokenizer, ids, SamplingParams(temperature=0.0), max_tokens=8)
    assert [e.token for e in g] == summary["ids"] and len(summary["ids"]) >= 1


@pytest.mark.parametrize("target", ["nvfp4", "nvfp4-ggml"])
def test_cuda_decode_path_with_fused_nvfp4_matvec(make_gguf, tmp_path, kernels, target, monkeypatch):
    """The CUDA decode step as the GPU runs it (the NVFP4 Triton dequant-matvec for every
    projection, Triton attention), minus the capture, under the Triton interpreter, vs the eager
    path, on a narrow fixture."""
    from muser.gates import GATE_FLOOR, max_dlsm

    import numpy as np

    master = make_gguf(SynthSpec(hidden=256, ffn=256, n_heads=4, head_dim=32, dtype="F32"))
    path = convert(master, tmp_path / f"{target}.gguf", target)
    prompt = [6 + (i * 37) % 370 for i in range(33)]
    eng = Engine.open(path, device="cpu", lane="exact", kv="f16")
    ref = eng.session(max_context=64)
    ref.prefill(prompt)
    s = eng.session(max_context=64)
    s.prefill(prompt)
    from muser.engine.kernels import nvfp4 as knv

    calls = []
    real = knv.matvec_nvfp4
    monkeypatch.setattr(knv, "matvec_nvfp4", lambda w, x, out=None: calls.append(w.fmt) or real(w, x, out))
    for L in eng.weights.layers:  # the CPU GEMM stacks off: every projection takes the CUDA route
        L.attn_in = L.ffn_in = None
    eng.forward.linear.triton = True
    try:
        got = eng.graph(((1, "last", s.max_context),), ()).run([s], [np.array([5])]).numpy().copy()
    finally:
        eng.forward.linear.triton = False
    assert max_dlsm(got, ref.decode(5)) <= GATE_FLOOR
    assert len(calls) == 8 * eng.cfg.n_layers  # every projection of every layer took the NVFP4 kernel


@pytest.mark.parametrize("target", ["nvfp4", "nvfp4-ggml"])
def test_nvfp4_rows_do_not_depend_on_block_size(nvfp4_files, target):
    """Row invariance on the CPU exact lane (DESIGN.md): a token's logits are bitwise the same
    decoded alone or verified in a block of 4."""
    import numpy as np

    eng = Engine.open(nvfp4_files[target], device="cpu", lane="exact", kv="f32")
    prompt = [6 + (i * 37) % 370 for i in range(40)]
    block = [11, 12, 13, 14]
    a, b = eng.session(max_context=64), eng.session(max_context=64)
    a.prefill(prompt)
    b.prefill(prompt)
    alone = [a.decode(t) for t in block]
    together = b.prefill(block, all_logits=True)
    for i in range(len(block)):
        assert np.array_equal(alone[i].view(np.int32), together[i].view(np.int32)), i
