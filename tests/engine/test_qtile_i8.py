"""The integer lane's int8 tile (kernels/qtile_i8.py) on the CPU: gluon has no interpreter, so
what can be checked here is checked here, and the bits are checked on the GPU (the tile's
self-check against qmatmul_i8 at the fast lane's first CUDA call, tools/device_kernels.py against
matmul_ggml).

- The operand registers: `codes_ref` applies the PTX's word operations (shift, mask, the fifth
  bit, Q6_K's two high bits and its SWAR "- 32") to the engine's repacked fields, and they must be
  the contract's codes (dot.codes_from_fields), element for element, sub-block for sub-block.
- The compiled kernel (sm_90 SASS, tools/sass_loop.py tile): its IMMAs with no shared memory, no
  barrier and no spill, within the instruction budget the design rests on.
- The host checks: wrong activations, formats and tilings are refused before any launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from muser.engine.weights import random_bytes, repack
from muser.gguf.types import GgmlType as G
from muser.quant.dot import codes_from_fields

pytest.importorskip("triton")
qtile_i8 = pytest.importorskip("muser.engine.kernels.qtile_i8")
from muser.engine.kernels import qmatmul_i8  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _weight(fmt: G, n_out: int = 5, n_in: int = 768, seed: int = 3):
    raw = random_bytes(fmt, n_out, n_in, seed)
    return repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


@pytest.mark.parametrize("fmt", [G.Q4_K, G.Q5_K, G.Q6_K])
def test_operand_registers_hold_the_contracts_codes(fmt):
    w = _weight(fmt)
    fields = {k: v.numpy() for k, v in w.fields.items()}
    want = codes_from_fields(fmt, fields, w.n_in)["q"]  # float32 [S, k, O]
    got = qtile_i8.codes_ref(fmt, fields, w.n_in)  # int8 [O, S, k]
    assert got.dtype == np.int8 and got.shape == (w.n_out,) + want.shape[:2]
    assert np.array_equal(got.astype(np.float32), want.transpose(2, 0, 1))
    lo, hi = {G.Q4_K: (0, 15), G.Q5_K: (0, 31), G.Q6_K: (-32, 31)}[fmt]
    assert got.min() >= lo and got.max() <= hi
    # every code value occurs (random bytes): the bit operations are exercised over the range
    assert set(np.unique(got).tolist()) == set(range(lo, hi + 1))


def test_both_operands_take_the_same_element_at_each_k():
    """The operand order the loads set up (kernel: weight and activation words at (k % 16) // 4,
    halves at k // 16): a permutation of the 32 elements, the same on both sides, so each IMMA is
    the sub-block's integer dot; four consecutive k are four consecutive bytes of one 32-bit word
    (one register), and Q6_K's two 16-element sub-blocks are the threads t < 2 and t >= 2 (the
    activation masks)."""
    e = qtile_i8.operand_elements()
    assert sorted(e.tolist()) == list(range(32))
    k = np.arange(32)
    assert np.array_equal(e[k - k % 4] + k % 4, e) and np.all(e[k - k % 4] % 4 == 0)
    assert np.array_equal(e < 16, (k % 16) // 4 < 2)
    rng = np.random.default_rng(0)
    w, x = rng.integers(-32, 32, (2, 64, 32))
    assert np.array_equal((w[:, e] * x[:, e]).sum(1), (w * x).sum(1))
    assert np.array_equal((w[:, e] * x[:, e] * (e < 16)).sum(1), (w[:, :16] * x[:, :16]).sum(1))


def test_config_and_inputs_are_refused_before_any_launch():
    for bad in [(48, 8, 4, 0), (64, 8, 3, 0), (64, 12, 4, 0), (32, 8, 4, 0), (512, 8, 4, 0), (64, 8, 4, 2),
                (64, 8, 4), "64,8"]:
        with pytest.raises(ValueError, match="config"):
            qtile_i8.check_config(bad)
    assert qtile_i8.check_config((128, 16, 8, 1)) == (128, 16, 8, 1)
    assert {qtile_i8.config_for(t) for t in (1, 8)} == {qtile_i8.CONFIGS[8]}
    assert qtile_i8.config_for(9) == qtile_i8.CONFIGS[16] and qtile_i8.config_for(512) == qtile_i8.CONFIGS[64]
    w = _weight(G.Q4_K)
    q8 = qmatmul_i8.Act(G.Q8_0, torch.zeros(2, 768, dtype=torch.int8), torch.zeros(2, 24), None)
    with pytest.raises(ValueError, match="Q8_K activations of 768"):
        qtile_i8.matmul_tile(w, q8)
    short = qmatmul_i8.Act(G.Q8_K, torch.zeros(2, 512, dtype=torch.int8), torch.zeros(2, 2),
                           torch.zeros(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="768 columns"):
        qtile_i8.matmul_tile(w, short)
    act = qmatmul_i8.Act(G.Q8_K, torch.zeros(2, 768, dtype=torch.int8), torch.zeros(2, 3),
                         torch.zeros(2, 24, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        qtile_i8.matmul_tile(w, act, torch.empty(2, 4))
    from muser.errors import LaneError

    with pytest.raises(LaneError, match="Q8_0 has no int8 tile"):
        qtile_i8.matmul_tile(_weight(G.Q8_0, n_in=768), act)
    assert not qtile_i8.available("cpu")


def _sass(tmp_path, *args: str, kernel: str = "tile") -> tuple[str, str, dict[str, int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, str(REPO / "tools" / "sass_loop.py"), kernel, *args], env=env,
                       capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    head, ops, budget = p.stdout.strip().splitlines()[:3]
    counts = {o.split(":")[0]: int(o.split(":")[1]) for o in ops.strip().split(", ")}
    return head + budget, ops, counts


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_tile_prefetch_keeps_the_next_blocks_loads_in_flight_during_the_immas(tmp_path, fmt):
    """PF 1: the next 256-block's weight words are loaded inside this block's iteration and first
    read after its last IMMA (they are in flight while it computes); PF 0 reads every word it
    loads before its last IMMA (a block's loads feed its own IMMAs, and it waits for them). Both
    loops issue the same loads a block."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    ahead, total = {}, {}
    for pf in (0, 1):
        p = subprocess.run([sys.executable, str(REPO / "tools" / "sass_loop.py"), "tile", fmt, "1", "--config",
                            f"64,8,4,{pf}", "--dump"], env=env, capture_output=True, text=True, timeout=280)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        body = [ln.split("\t", 1)[1] for ln in p.stdout.splitlines()[3:] if "\t" in ln]
        last = max(i for i, ln in enumerate(body) if "IMMA" in ln)
        ahead[pf] = sum(_first_read(body, i) > last for i, ln in enumerate(body) if "LDG" in ln)
        total[pf] = sum("LDG" in ln for ln in body)
    assert total[0] == total[1], total
    words = 8 if fmt == "Q4_K" else 12  # a thread's 8-byte qs (Q6_K: ql and qh) loads of one block
    assert ahead[1] >= words and ahead[0] < ahead[1], ahead


def test_ring_config_is_refused_before_any_launch():
    for bad in [(48, 16, 4, 4), (64, 16, 8, 4), (64, 12, 4, 4), (256, 16, 4, 4), (64, 16, 4, 5), (64, 64, 4, 4),
                (128, 32, 4, 6), (64, 16, 4), "64,16"]:
        with pytest.raises(ValueError, match="ring config"):
            qtile_i8.check_ring_config(bad)
    assert qtile_i8.check_ring_config((64, 16, 4, 4)) == (64, 16, 4, 4)
    assert qtile_i8.ring_bytes(64, 16, 4) == 4 * (64 * 192 + 16 * 256) <= qtile_i8.RING_BYTES
    w = _weight(G.Q8_0, n_in=768)
    act = qmatmul_i8.Act(G.Q8_K, torch.zeros(2, 768, dtype=torch.int8), torch.zeros(2, 3),
                         torch.zeros(2, 24, dtype=torch.int32))
    from muser.errors import LaneError

    with pytest.raises(LaneError, match="no int8 tile"):
        qtile_i8.matmul_ring(w, act)
    # a chunk group is a split call's: a walking program, or a call of more than SPLIT_ROWS rows (it
    # walks), has none; and it is an int from 1 to MAX_GROUP
    k = _weight(G.Q4_K, n_in=768)
    for rows, split, group, what in [(2, False, 2, "group 2"), (17, None, 2, "group 2"), (2, None, 0, "group 0"),
                                     (2, True, qtile_i8.MAX_GROUP + 1, f"group {qtile_i8.MAX_GROUP + 1}"),
                                     (2, True, 2.0, "group 2.0")]:
        act = qmatmul_i8.Act(G.Q8_K, torch.zeros(rows, 768, dtype=torch.int8), torch.zeros(rows, 3),
                             torch.zeros(rows, 24, dtype=torch.int32))
        with pytest.raises(ValueError, match=what):
            qtile_i8.matmul_ring(k, act, split=split, group=group)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt,rows,config,walk,imma", [
    ("Q4_K", "16", "64,16,4,4", False, 32), ("Q6_K", "16", "64,16,4,4", False, 32),
    ("Q5_K", "1", "32,8,2,4", True, 16)])
def test_ring_copies_blocks_ahead_into_shared_memory(tmp_path, fmt, rows, config, walk, imma):
    """The ring variant's loop as compiled for sm_90: the code bytes and activation codes arrive by
    cp.async (LDGSTS: 16 bytes a thread and copy, committed as one group a block and waited for
    S - 2 groups behind), the operands come from shared memory by ldmatrix, one barrier a block;
    the only global loads left in the loop are the small fields one block ahead; the same IMMAs
    as the tile; nothing in local memory; the shared memory is the ring's; no 64-bit conversion or
    arithmetic (the terms and sums are float32, dot.py)."""
    bn, bm, nw, s = (int(v) for v in config.split(","))
    head, ops, counts = _sass(tmp_path, fmt, rows, "--config", config, *(["--walk"] if walk else []), kernel="ring")
    assert not {"DMUL", "DADD", "DFMA", "F2F", "I2F"} & set(counts), ops
    assert counts.get("IMMA") == imma and counts.get("LDGSTS", 0) >= 3 and counts.get("LDSM", 0) >= 4, ops
    assert counts.get("DEPBAR") == 1 and counts.get("BAR") and "STL" not in counts and "LDL" not in counts, ops
    assert counts.get("LDG", 0) <= 14, ops
    assert f"shared={qtile_i8.ring_bytes(bn, bm, s) - s * bn * (0 if fmt == 'Q6_K' else 32 if fmt == 'Q5_K' else 64)}" \
        in head, head


def _first_read(body: list[str], i: int) -> int:
    """The index of the first instruction after body[i] (an instruction with a destination
    register) that reads that register, or len(body) where none in the loop does (its value is
    read in the next iteration)."""
    ops = body[i].split(";")[0].split(None, 2 if body[i].startswith("@") else 1)[-1]
    dest = re.match(r"\s*(R\d+)", ops)
    if dest is None:
        return -1
    reg = re.compile(rf"\b{dest.group(1)}\b")
    for j in range(i + 1, len(body)):
        ins = body[j].split(";")[0]
        ops_j = ins.split(None, 2 if ins.startswith("@") else 1)[-1].split(",")
        if any(reg.search(o) for o in ops_j[1:]):
            return j
        if reg.fullmatch(ops_j[0].strip()):  # redefined before any read
            return len(body)
    return len(body)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt,rows,imma,limit,ldl,config", [
    ("Q4_K", "1", 16, 0.1, 0, None), ("Q6_K", "1", 16, 0.13, 0, None), ("Q4_K", "16", 64, 0.11, 0, None),
    ("Q5_K", "16", 64, 0.13, 8, None), ("Q4_K", "512", 64, 0.11, 0, None),
    ("Q4_K", "1", 16, 0.1, 0, "64,8,4,1"), ("Q5_K", "1", 16, 0.14, 0, "64,8,4,1"), ("Q6_K", "1", 16, 0.13, 0, "64,8,4,1"),
    ("Q4_K", "16", 32, 0.14, 0, "64,16,4,1")])
def test_tile_loop_unpacks_operands_in_registers(tmp_path, fmt, rows, imma, limit, ldl, config):
    """A 256-block of the tile's loop as compiled for sm_90: per m-tile of a warp and n-tile two IMMAs
    per 32 codes (Q4_K/Q5_K: the codes and the row's min, both against the same activations; Q6_K
    one per 16 codes; above one row a warp takes two m-tiles), the operands
    straight from 8-byte loads (no shared memory, no barrier), within the warp-instruction budget
    a weight that keeps a decode under the weight stream (bench/NOTES.md: ~0.1 a weight is ~2.7 ms
    a token of the 28 G). Nothing is stored to local memory inside the loop; the two-m-tile
    tilings at 254-255 registers may keep values there from outside it (Q5_K at 16 rows reloads
    four a block): measured 23-33 % faster than the spill-free (64, 16, 4) on the H200
    (bench/receipts/20261205T043516Z-kernels-cuda.json), and the four reloads of the chunk-fastest
    program order faster than the one before it (Q5_K 202048 x 6656 at 16 rows 790.1 against
    840.0 us on an H100, bench/receipts/20261205T190244Z-kernels-cuda.json). The terms and sums
    are float32 (dot.py): no 64-bit conversion or arithmetic in the loop."""
    head, ops, counts = _sass(tmp_path, fmt, rows, *(["--config", config] if config else []))
    assert not {"DMUL", "DADD", "DFMA", "F2F", "I2F"} & set(counts), ops
    assert counts.get("IMMA") == imma, ops
    assert not {"BAR", "LDS", "STS", "STL"} & set(counts), ops
    assert counts.get("LDL", 0) <= ldl, ops
    assert "shared=0" in head, head
    assert float(head.split("  ")[-1].split()[0]) <= limit, head


_LAYOUT_SCRIPT = '''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource


@gluon.jit
def operands(x, BN: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    gl.static_print(gl.to_linear_layout(gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4), [BN, 32]))
    gl.static_print(gl.to_linear_layout(gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4), [32, BM]))


for cfg in sys.argv[1:]:
    bn, bm, nw = (int(v) for v in cfg.split(","))
    print("config", cfg, flush=True)
    src = GluonASTSource(operands, {"x": "*i8", "BN": "constexpr", "BM": "constexpr", "NW": "constexpr"},
                         constexprs={(1,): bn, (2,): bm, (3,): nw})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
'''


@pytest.mark.timeout(300)
def test_a_register_of_four_int8_operands_is_one_word(tmp_path):
    """The inline PTX takes four operands at a time (pack=4) and treats them as one 32-bit word of
    ggml's bytes: that holds only if a thread's registers 0-3 of each group are four consecutive k
    of one weight row (A) or activation row (B). The 8-byte loads (_ld_a, pack=16; _ld_b, pack=8)
    put a word's low half in the k-low group and its high half in the k-high group of the same row:
    that holds only if the next register bases are row + 8 then k + 16 (A) and k + 16 (B). The
    operand layouts as Triton lays them out (linear layouts, compiled for sm_90) for every shipped
    and swept tiling: register bases k+1, k+2 first, lanes over k in steps of 4 and 8 (the m16n8k32
    fragment), warps over weight rows only (each warp its own rows; activations shared)."""
    script = tmp_path / "layouts.py"
    script.write_text(_LAYOUT_SCRIPT)
    cfgs = sorted({*(c[:3] for c in qtile_i8.CONFIGS.values()), (16, 8, 1), (32, 8, 2), (128, 8, 8), (128, 16, 8),
                   (32, 16, 2), (256, 16, 8)})  # (BN, BM, num_warps): PF does not change a layout
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, str(script), *(",".join(map(str, c)) for c in cfgs)], env=env,
                       capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    import ast
    import re

    def bases(line: str) -> dict:
        return {k: ast.literal_eval(re.search(k + r"=(\[(?:\[[-\d, ]*\](?:, )?)*\])", line).group(1))
                for k in ("reg_bases", "lane_bases", "warp_bases")}

    lines = p.stdout.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("config ")]
    assert len(heads) == len(cfgs), p.stdout[-3000:]
    for i in heads:
        cfg, a, b = lines[i], bases(lines[i + 1]), bases(lines[i + 2])
        ra, la, wa = a["reg_bases"], a["lane_bases"], a["warp_bases"]  # A [BN, k]
        # a thread's 16 registers of an m-tile: (row g, k low), (g + 8, low), (g, high), (g + 8, high),
        # each four consecutive k (_ld_a's pack of 16 and _nib's of 4)
        assert ra[:4] == [[0, 1], [0, 2], [8, 0], [0, 16]] and la[:2] == [[0, 4], [0, 8]], (cfg, ra, la)
        assert all(w[1] == 0 for w in wa), (cfg, ra, wa)
        rb, lb, wb = b["reg_bases"], b["lane_bases"], b["warp_bases"]  # B [k, BM]
        # (k low, column), (k high, column): _ld_b's pack of 8
        assert rb[:3] == [[1, 0], [2, 0], [16, 0]] and lb[:2] == [[4, 0], [8, 0]], (cfg, rb, lb)
        assert all(w == [0, 0] for w in wb), (cfg, rb, wb)


def test_the_stream_k_walk_is_refused_off_a_walking_call_of_one_activation_tile():
    """The stream-K walk (`stream`, programs an SM) serves a walking call (split false) of at most
    BM rows; anything else, or a count out of range, is refused before any launch."""
    k = _weight(G.Q4_K, 72, 1280)
    for rows, split, stream, cfg, what in [(2, None, 3, (64, 16, 4, 4), "stream 3"),
                                           (17, False, 3, (64, 16, 4, 4), "stream 3"),
                                           (9, False, 2, (64, 8, 4, 4), "stream 2"),
                                           (2, False, qtile_i8.MAX_STREAM + 1, (64, 16, 4, 4), "stream 9"),
                                           (2, False, 1.0, (64, 16, 4, 4), "stream 1.0")]:
        act = qmatmul_i8.Act(G.Q8_K, torch.zeros(rows, 1280, dtype=torch.int8), torch.zeros(rows, 5),
                             torch.zeros(rows, 40, dtype=torch.int32))
        with pytest.raises(ValueError, match=what):
            qtile_i8.matmul_ring(k, act, config=cfg, split=split, stream=stream)
    act = qmatmul_i8.Act(G.Q8_K, torch.zeros(2, 1280, dtype=torch.int8), torch.zeros(2, 5),
                         torch.zeros(2, 40, dtype=torch.int32))
    with pytest.raises(ValueError, match="programs 0"):
        qtile_i8.matmul_ring(k, act, split=False, programs=0)


def test_the_stream_k_walk_is_one_launch_of_equal_runs_of_tile_chunks(monkeypatch):
    """A stream-K call: one launch of min(U, stream x SMs or `programs`) programs over U = tiles x
    chunks units, a [chunks, T, N] f32 buffer for shared tiles' chunk sums and the device's arrival
    counters (zero, one a tile at least), its registers capped so `stream` programs fit an SM
    (65,536 / (stream x threads)); and the self-check's weight (4 x BN + 24 rows, 2,304 columns)
    on 4 programs shares tiles between two programs at both ends of a run, on 12 a tile between
    three (a program with neither its first nor its last chunk)."""
    from triton.runtime.jit import JITFunction

    got: list = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid=None, warmup=False, **kw:
                        got.append((self.fn.__name__, grid, kw, args)))
    w = _weight(G.Q4_K, 4 * 64 + 24, 2304)
    act = qmatmul_i8.Act(G.Q8_K, torch.zeros(16, 2304, dtype=torch.int8), torch.zeros(16, 9),
                         torch.zeros(16, 72, dtype=torch.int32))
    qtile_i8.matmul_ring(w, act, config=(64, 16, 4, 4), split=False, stream=3, programs=4)
    qtile_i8.matmul_ring(w, act, config=(64, 16, 4, 4), split=False, stream=2)  # one SM off CUDA: 2 programs
    qtile_i8.matmul_ring(w, act, config=(64, 16, 4, 4), split=False, stream=3, programs=40)  # at most U
    (name, grid, kw, args), (_, grid2, kw2, _), (_, grid3, _, _) = got
    assert name == "_ring_sk_kernel" and grid == (4,) and grid2 == (2,) and grid3 == (15,), got
    assert kw["NCH"] == 3 and kw["maxnreg"] == 168 and kw2["maxnreg"] == 255, kw
    part, cnt, U = args[3], args[4], args[15]
    assert part.shape == (3, 16, 280) and part.dtype == torch.float32 and U == 5 * 3
    assert cnt is qtile_i8.sk_counters("cpu", 1) and cnt.dtype == torch.int32 and not cnt.any()

    def runs(P):  # program p's units [p U / P, (p + 1) U / P), by tile: the chunk ranges it takes
        return [{u // 3: (min(v for v in range(p * U // P, (p + 1) * U // P) if v // 3 == u // 3) % 3,
                          max(v for v in range(p * U // P, (p + 1) * U // P) if v // 3 == u // 3) % 3 + 1)
                 for u in range(p * U // P, (p + 1) * U // P)} for p in range(P)]

    def sharers(P, t):  # the kernel's count of a tile's programs, and the first one's chunks
        q0, q1 = ((t * 3 + 1) * P - 1) // U, ((t * 3 + 3) * P - 1) // U
        return q1 - q0 + 1, (q0 + 1) * U // P - t * 3

    for P in (4, 12):
        r = runs(P)
        for t in range(5):
            takers = [p for p in range(P) if t in r[p]]
            n, h = sharers(P, t)
            assert n == len(takers) and (n == 1 or h == r[takers[0]][t][1]), (P, t, takers, n, h)
    r4, r12 = runs(4), runs(12)
    assert r4 == [{0: (0, 3)}, {1: (0, 3), 2: (0, 1)}, {2: (1, 3), 3: (0, 2)}, {3: (2, 3), 4: (0, 3)}]
    assert any(c == (1, 2) for d in r12 for c in d.values())  # a middle chunk: a tile shared by three


@pytest.mark.timeout(600)
def test_the_stream_k_walk_keeps_the_rings_loop(tmp_path):
    """The stream-K walk as compiled for sm_90 at three programs an SM: at most 168 registers (three fit),
    the ring's loop (cp.async copies, ldmatrix operands, the same IMMAs) with nothing in local
    memory inside it and no longer than the walk's loop (a segment loop counted from its runtime
    start chunk compiled 16 % longer); a shared tile's arrival one add at GPU scope behind a fence
    (the release of the sums stored before it), its counter set back to 0 by an exchange, and no
    wait."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, str(REPO / "tools" / "sass_loop.py"), "ring", "Q4_K", "16", "--walk",
                        "--stream", "3", "--programs", "396", "--n-out", "39936", "--n-in", "6656", "--grep",
                        r"ATOM|MEMBAR"], env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    head, ops = lines[0], lines[1]
    counts = {o.split(":")[0]: int(o.split(":")[1]) for o in ops.strip().split(", ")}
    assert int(head.split("regs=")[1].split()[0]) <= 168 and counts.get("IMMA") == 32 and counts.get("LDGSTS", 0) >= 3, head + ops
    assert "STL" not in counts and "LDL" not in counts, ops
    walk = subprocess.run([sys.executable, str(REPO / "tools" / "sass_loop.py"), "ring", "Q4_K", "16", "--walk",
                           "--n-out", "39936", "--n-in", "6656"], env=env, capture_output=True, text=True, timeout=280)
    assert walk.returncode == 0, walk.stdout[-3000:] + walk.stderr[-3000:]
    loop = [int(ln.split("loop=")[1].split()[0]) for ln in (head, walk.stdout.splitlines()[0])]
    assert loop[0] <= loop[1], loop
    grep = lines[3:]
    assert any("MEMBAR" in ln and "GPU" in ln for ln in grep), grep  # the release of the sums stored
    assert any("ATOMG.E.ADD" in ln and "GPU" in ln for ln in grep), grep  # the tile's arrival
    assert any("ATOMG.E.EXCH" in ln and "GPU" in ln for ln in grep), grep  # its counter back to 0
    assert not any("CAS" in ln for ln in grep), grep  # no program waits on another
