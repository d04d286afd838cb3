#!/usr/bin/env python3
"""Static check of the int8 tensor-core tile with explicit layouts (triton.experimental.gluon, in
the pinned Triton on both machines), without a GPU: a [BM, K] int8 activation tile times 4-bit
weight codes unpacked in registers, straight into the mma operand layout, compiled for sm_90;
prints the compiled loop's instruction counts and the kernel's shared memory.

The weight words are laid out for the operand: per output column n and 32-element block, four
int32 words; word t holds the codes of k = 4t .. 4t + 3 in its low nibbles (byte order) and of
k = 16 + 4t .. 16 + 4t + 3 in its high nibbles, which are exactly the two registers a thread
holds of an m16n8k32 B fragment. So a word is one 4-byte load and three instructions (shift, two
ands) to two IMMA operand registers, with no shared-memory round trip (bench/NOTES.md, "Verify
at decode cost needs tensor cores").

    python3 tools/sass_gluon_tile.py [--bm 16] [--bn 64] [--bk 64] [--warps 4] [--scaled] [--dump]

On the GPU machine `probe()` runs it (tools/device_kernels.py): outputs against an exact product
of the decoded codes, and GB/s of the weight bytes beside a device copy of them.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402
from triton.tools.disasm import get_sass  # noqa: E402

from sass_loop import loop_body  # noqa: E402


@gluon.jit
def _tile(a_ptr, q_ptr, s_ptr, c_ptr, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
          NW: gl.constexpr, SCALED: gl.constexpr):
    """c [BM, N] int32 = a [BM, K] int8 x codes [N, K]^T, the codes 4-bit in the fragment word
    layout (module doc); a program takes BN columns, BK elements an iteration in 32-element
    blocks. SCALED: each block's integer sums times the column's block scale (u8 [N, K/32]) before
    they join the accumulator, as a K-quant sub-block scale would be applied (int32, exact).
    N % BN == 0 and K % BK == 0."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    la: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    lb: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    n0 = gl.program_id(0) * BN
    om = gl.arange(0, BM, layout=gl.SliceLayout(1, la))
    oka = gl.arange(0, 32, layout=gl.SliceLayout(0, la))
    okb = gl.arange(0, 32, layout=gl.SliceLayout(1, lb))
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, lb))
    cn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    wsel = okb % 16 // 4  # the word of a 32-element block holding code k
    shb = gl.full([32, BN], 0, gl.int32, layout=lb) + (okb // 16 * 4)[:, None]  # its low (0) or high (4) nibbles
    ap = a_ptr + om[:, None] * K + oka[None, :]  # [BM, 32]: block 0's activations
    qp = q_ptr + on[None, :].to(gl.int64) * (K // 8) + wsel[:, None]  # [32, BN]: block 0's words
    sp = s_ptr + cn.to(gl.int64) * (K // 32)  # [BN]: block 0's scales
    acc = gl.zeros([BM, BN], gl.int32, layout=mma)
    for k0 in range(0, K, BK):
        for sb in gl.static_range(BK // 32):
            kb = k0 + 32 * sb
            a = gl.load(ap + kb)  # [BM, 32] int8, the A fragments
            words = gl.load(qp + kb // 8)  # a block's four words at 4 (kb / 32)
            codes = gl.inline_asm_elementwise("{ .reg .b32 t; shr.u32 t, $4, $8; and.b32 $0, t, 0x0F0F0F0F; }",
                                              "=r,r,r,r,r,r,r,r,r", [words, shb], dtype=gl.int8, is_pure=True,
                                              pack=4)  # four consecutive k of a thread: one register
            if SCALED:
                isum = mma_v2(a, codes, gl.zeros([BM, BN], gl.int32, layout=mma))
                sc = gl.load(sp + kb // 32).to(gl.int32)  # [BN]
                acc = acc + isum * sc[None, :]
            else:
                acc = mma_v2(a, codes, acc)
    cm = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    gl.store(c_ptr + cm[:, None] * N + cn[None, :], acc)


def codes_of(words):
    """The fragment word layout's codes: int32 words [N, K/8] -> uint8 codes [N, K] (torch)."""
    import torch

    n = words.shape[0]
    w = words.view(n, -1, 4)  # [N, K/32 blocks, word t]
    b = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], -1)  # [N, blocks, t, byte i]: k = 4t + i
    lo, hi = (b & 0xF).reshape(n, -1, 16), ((b >> 4) & 0xF).reshape(n, -1, 16)
    return torch.cat([lo, hi], -1).reshape(n, -1).to(torch.uint8)


def probe(device: str = "cuda", n: int = 39936, k: int = 6656, bm: int = 16, bn: int = 64, bk: int = 64,
          warps: int = 4, scaled: bool = False, launches: int = 20, reps: int = 5) -> dict:
    """The tile on random codes and activations on `device`: its int32 outputs against an exact f64
    product of the decoded codes (the layout's index math), and its time per launch in a CUDA graph
    (one warm replay, then `reps`) beside a device copy of the same weight bytes."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32).to(device)
    a = torch.randint(-127, 128, (bm, k), generator=g, dtype=torch.int64).to(torch.int8).to(device)
    sc = torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.int64).to(torch.uint8).to(device)
    c = torch.empty(bm, n, dtype=torch.int32, device=device)

    def run():
        _tile[(n // bn,)](a, words, sc, c, n, k, BM=bm, BN=bn, BK=bk, NW=warps, SCALED=scaled, num_warps=warps)

    run()
    codes = codes_of(words).double().view(n, k // 32, 32)
    if scaled:  # per block the integer sums times the block scale
        ref = torch.einsum("mbk,nbk,nb->mn", a.double().view(bm, k // 32, 32), codes, sc.double()).to(torch.int64)
    else:
        ref = (a.double() @ codes.view(n, k).T).to(torch.int64)
    exact = bool(torch.equal(c.to(torch.int64), ref))

    from device_kernels import graph_seconds  # the stage's CUDA-graph timer

    dst = torch.empty_like(words)
    tile_s, copy_s = graph_seconds(run, launches, reps), graph_seconds(lambda: dst.copy_(words), launches, reps)
    nbytes = words.numel() * 4 + (sc.numel() if scaled else 0)
    mean = sum(tile_s) / len(tile_s)
    return {"n": n, "k": k, "config": [bm, bn, bk, warps], "scaled": scaled, "exact_vs_f64": exact, "weight_bytes": nbytes,
            "tile_us": mean * 1e6, "tile_samples_s": tile_s, "tile_GBps": nbytes / mean / 1e9,
            "copy_read_write_GBps": 2 * nbytes / (sum(copy_s) / len(copy_s)) / 1e9, "copy_samples_s": copy_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bm", type=int, default=16)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--bk", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--scaled", action="store_true", help="each 32-element block's sums times a column scale")
    ap.add_argument("--dump", action="store_true")
    a = ap.parse_args(argv)
    sig = {"a_ptr": "*i8", "q_ptr": "*i32", "s_ptr": "*u8", "c_ptr": "*i32", "N": "i32", "K": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "NW": "constexpr", "SCALED": "constexpr"}
    src = GluonASTSource(_tile, sig, constexprs={(6,): a.bm, (7,): a.bn, (8,): a.bk, (9,): a.warps, (10,): a.scaled},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": a.warps})
    sass = get_sass(k.asm["cubin"])
    body = loop_body(sass)
    ops = Counter(re.search(r"\t(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln).group(1).split(".")[0] for ln in body)
    weights = a.bn * a.bk // a.warps  # weight codes a warp consumes per iteration
    print(f"gluon int8 tile BM={a.bm} BN={a.bn} BK={a.bk} warps={a.warps} scaled={a.scaled}: shared={k.metadata.shared} B, "
          f"loop={len(body)} instr a warp for {weights} weights x {a.bm} rows "
          f"({len(body) / weights:.4f} warp-instructions a weight)")
    print("  " + ", ".join(f"{o}:{c}" for o, c in ops.most_common()))
    if a.dump:
        print("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
