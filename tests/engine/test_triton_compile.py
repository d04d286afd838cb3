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
    # the decode path's kernels are all there: attention (partial + reduce), matvec, dequant
    assert {"_attn_partial", "_attn_reduce", "_matvec_kernel", "_dequant_kernel", "_matvec_v3_kernel", "_act_prep_kernel",
            "_dequant_v3_kernel", "_matvec_nvfp4_kernel", "_dequant_nvfp4_kernel", "_norm_mul_kernel", "_norm2_kernel", "_qk_norm_rope_kernel",
            "_gate_kernel", "_qmatmul_i8_kernel", "_qtile_kernel", "_chunk_reduce_kernel", "_quant_kernel"} <= kernels
    assert all(r["ok"] for r in rows)
    # each variant's registers and stack, read from its cubin (Triton ships the cuobjdump)
    assert all(0 < r["registers"] <= 255 and r["stack_bytes"] >= 0 for r in rows)
    # the step's kernels take PDL on sm_90 (engine/kernels/gdc.py), each waiting for the kernel
    # before it ahead of every store and every load but the matvec's weights (pdl_order)
    step = {"_attn_partial", "_attn_reduce", "_matvec_v3_kernel", "_act_prep_kernel", "_norm_mul_kernel",
            "_norm2_kernel", "_qk_norm_rope_kernel", "_gate_kernel", "_kv_round_kernel", "_kv_store_kernel"}
    pdl = [r for r in rows if r["kernel"] in step]
    assert pdl and all(r["options"].get("launch_pdl") and r["pdl_order"] is None for r in pdl)


def test_pdl_order_check_refuses_an_early_read_or_store(monkeypatch):
    """tools/triton_aot_check.py's PTX check: a load through an activation pointer or any global
    store ahead of griddepcontrol.wait fails it; weight loads of the matvec, the attention's
    metadata and a store to the program's shared memory pass."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tool refuses the interpreter
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    from triton_aot_check import pdl_order

    head = ("ld.param.b64 %rd1, [_k_param_0];", "ld.param.b64 %rd2, [_k_param_1];", "add.s64 %rd3, %rd1, 16;",
            "add.s64 %rd4, %rd2, 16;")
    ok = "\n".join(head + ("@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd4 + 0 ];", "griddepcontrol.wait;",
                           "ld.global.b32 %r5, [%rd3];"))
    assert pdl_order(ok, "_matvec_v3_kernel", ["x", "qp"]) is None
    assert pdl_order(ok, "_matvec_v3_kernel", ["qp", "x"]).startswith("before the wait: ld.global")
    assert pdl_order(ok, "_norm2_kernel", ["x", "qp"]).startswith("before the wait: ld.global")
    store = "\n".join(head + ("st.global.b32 [%rd4], %r1;", "griddepcontrol.wait;"))
    assert pdl_order(store, "_matvec_v3_kernel", ["x", "qp"]).startswith("before the wait: st.global")
    assert pdl_order("ld.global.b32 %r5, [%rd3];", "_gate_kernel", []) == "no griddepcontrol.wait"
    # a program's own shared memory (a reduction across its warps) may be written first; the
    # attention partial reads the step's metadata and position first, its K/V/q after the wait
    shared = "\n".join(head + ("st.shared.b32 [%r9], %r1;", "griddepcontrol.wait;"))
    assert pdl_order(shared, "_norm2_kernel", ["x", "qp"]) is None
    assert pdl_order(ok, "_attn_partial", ["q", "meta"]) is None
    assert pdl_order(ok, "_attn_partial", ["meta", "q"]).startswith("before the wait: ld.global")
    # an address read from the metadata (the K/V storage) is not followed before the wait
    chase = "\n".join(head[:1] + ("ld.global.b64 %rd5, [%rd1+32];", "ld.global.b16 %rs1, [%rd5];",
                                   "griddepcontrol.wait;"))
    assert pdl_order(chase, "_attn_partial", ["meta"]).startswith("before the wait: ld.global.b16")


def _sass_loop(tmp_path, *args: str) -> tuple[str, str, dict[str, int], int]:
    """tools/sass_loop.py ARGS compiled for sm_90: (its header line, its op line, the op counts,
    the loop's instruction count)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, str(REPO / "tools" / "sass_loop.py"), *args], env=env, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    head, ops = p.stdout.strip().splitlines()[:2]
    counts = {o.split(":")[0]: int(o.split(":")[1]) for o in ops.strip().split(", ")}
    return head, ops, counts, int(head.split("loop=")[1].split()[0])


@pytest.mark.timeout(300)
def test_v3_one_row_loop_has_no_shared_memory_round_trip(tmp_path):
    """The v3 decode loop as compiled for sm_90 (tools/sass_loop.py): its loads, scales and
    accumulator share one thread layout, so the loop has no barrier or shared-memory shuffle,
    and it issues at most 4.25 instructions per Q4_K weight (the factored dot: 4.0; the decoded
    weight's dot before it: 6.0, bench/NOTES.md)."""
    head, ops, counts, n = _sass_loop(tmp_path, "v3", "Q4_K", "1", "--config", "16,4,1")
    # 16 rows x 32 units x 32 elements / 128 threads = 128 weights: one fma each but the first
    # nibble's (a multiply), and two a thread's accumulator slot (4 rows x 4 unit lanes: d1, m1)
    assert counts.get("FFMA", 0) == 128 - 16 + 2 * 16
    assert "BAR" not in counts and "STS" not in counts and "LDS" not in counts, ops
    assert n / 128 <= 4.25, head


@pytest.mark.timeout(300)
def test_v3_several_row_loop_keeps_rows_in_registers(tmp_path):
    """The v3 several-row loop as compiled for sm_90 (tools/sass_loop.py; 16 rows, 8 weight rows
    a program on 4 warps: 4 weight rows a thread, 4 activation rows a program): the words, the
    activation pairs, the per-unit scales and every row's accumulators share one thread layout,
    so the loop has no barrier, no shared-memory shuffle and no spill, its FFMAs are the
    arithmetic's own, and it issues at most 2.2 instructions per weight and row (the one-row
    layout's loop it replaced: 2.36 at 4 x 2, bench/NOTES.md)."""
    head, ops, counts, n = _sass_loop(tmp_path, "v3", "Q4_K", "16", "--config", "8,4,0", "--rt", "4")
    # a thread: 4 weight rows x one word pair of a unit (2 lanes x 8 nibbles) x 4 activation rows =
    # 256 products, one fma each but the first nibble's (a multiply: 32), and two a row's
    # accumulator slot (2 x 32)
    assert counts.get("FFMA", 0) == 256 - 32 + 2 * 32
    assert "BAR" not in counts and "STS" not in counts and "LDS" not in counts, ops
    assert "local=False" in head, head
    assert n / 256 <= 2.2, head


@pytest.mark.timeout(300)
def test_gluon_int8_tile_takes_its_operands_from_registers(tmp_path):
    """The explicit-layout int8 tile (tools/sass_gluon_tile.py): 4-bit codes loaded as one word per
    operand register pair and unpacked in registers straight into the m16n8k32 B fragments, so the
    compiled loop has its IMMAs and no shared memory or barrier, at under 0.06 warp-instructions a
    weight for 16 activation rows (the one-row CUDA-core matvec: ~0.11 for one row)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, str(REPO / "tools" / "sass_gluon_tile.py")], env=env, capture_output=True,
                       text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    head, ops = p.stdout.strip().splitlines()[:2]
    counts = {o.split(":")[0]: int(o.split(":")[1]) for o in ops.strip().split(", ")}
    # BN 64 over 4 warps x BK 64: 2 column tiles x 2 k-steps of m16n8k32 a warp
    assert counts.get("IMMA") == 4 and "BAR" not in counts and "LDS" not in counts and "STS" not in counts, ops
    assert "shared=0 B" in head, head
    assert float(head.split("(")[1].split()[0]) < 0.06, head
    # each 32-element block's sums scaled per column in int32 (a K-quant sub-block scale): still
    # no shared memory, under 0.1 warp-instructions a weight for 16 rows
    p = subprocess.run([sys.executable, str(REPO / "tools" / "sass_gluon_tile.py"), "--scaled"], env=env,
                       capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    head, ops = p.stdout.strip().splitlines()[:2]
    assert "IMMA:4" in ops and "LDS" not in ops and "BAR" not in ops and "shared=0 B" in head, head + ops
    assert float(head.split("(")[1].split()[0]) < 0.1, head


def test_gluon_tile_reference_reads_the_fragment_word_layout(tmp_path):
    """tools/sass_gluon_tile.codes_of, the reference the GPU probe checks the tile against: word t
    of a 32-element block holds k = 4t + i in byte i's low nibble and 16 + 4t + i in its high one
    (run in a process of its own: the explicit-layout module cannot load under the interpreter)."""
    script = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import sass_gluon_tile
code = torch.randint(0, 16, (3, 64), generator=torch.Generator().manual_seed(1))  # [N, K]
words = torch.zeros(3, 8, dtype=torch.int64)
for blk in range(2):
    for t in range(4):
        for i in range(4):
            lo, hi = code[:, 32 * blk + 4 * t + i], code[:, 32 * blk + 16 + 4 * t + i]
            words[:, 4 * blk + t] |= (lo | hi << 4) << (8 * i)
words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
assert torch.equal(sass_gluon_tile.codes_of(words).to(torch.int64), code)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, "-c", script, str(REPO / "tools")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout[-2000:] + p.stderr[-2000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attn_pass", [1, 2])
def test_attention_f16_key_block_loop_has_no_division_and_one_ex2_a_score(tmp_path, attn_pass):
    """The fast lane's attention passes as compiled for sm_90 (tools/sass_loop.py attn: 16 rows,
    a full layer at depth 32,768): a 32-key block's loop has no integer division (the ring slot
    is one conditional subtraction), forms each of a thread's 16 scores' exp with one ex2 and no
    subnormal guard (a compare and two predicated multiplies a score otherwise), and stays within
    330 instructions a thread (469 and 456 with both; bench/NOTES.md)."""
    _, ops, c, loop = _sass_loop(tmp_path, "attn", "full", "16", "--attn-pass", str(attn_pass))
    assert "I2F" not in c, ops  # an integer division's reciprocal
    assert c.get("FSETP", 0) <= 2 and c.get("MUFU", 0) <= 18, ops  # pass 1: + the two running-max rescales
    assert loop <= 330, ops
