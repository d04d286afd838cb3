#!/usr/bin/env python3
"""Static instruction budget of a matvec or attention kernel on sm_90, without a GPU: compile one launch the
way Triton's JIT specializes it (16-byte-aligned pointers, sizes divisible by 16), disassemble the
cubin with the bundled cuobjdump, find the innermost loop (the backward branch) and count its
instructions by class, then divide by the weights one thread decodes per iteration.

    python3 tools/sass_loop.py v3 FMT T [--config BN,NUM_WARPS,PIPE] [--rt 2|4] [--dump]
    python3 tools/sass_loop.py split FMT T [--config ...] [--rows-kernel 0|1] [--dump]
    python3 tools/sass_loop.py tile FMT T [--config BN,BM,NUM_WARPS] [--dump]   (the integer lane's int8 tile:
                                                                             its super-block loop)
    python3 tools/sass_loop.py ring FMT T [--config BN,BM,NUM_WARPS,S] [--walk | --group G] [--dump]   (its ring variant)
    python3 tools/sass_loop.py attn full|sliding T [--attn-pass 0|1|2] [--dump]   (attention at depth 32,768:
                                                                  the exact pass 0, the f16 passes 1, 2)

Used to predict a kernel's issue-bound ceiling before spending GPU time (bench/NOTES.md).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.disasm import get_sass  # noqa: E402

_TT = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
       torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}
_OPTS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg", "launch_pdl")


def capture(call, which: int = -1):
    """Run a host launcher with JITFunction.run patched; return (fn, args, kwargs, grid) of its
    launch number `which` (the last by default)."""
    got = []
    orig = JITFunction.run

    def fake(self, *args, grid=None, warmup=False, **kw):
        got.append((self, args, kw, grid))

    JITFunction.run = fake
    try:
        call()
    finally:
        JITFunction.run = orig
    return got[which]


def compile_like_jit(fn, args, kw):
    names = fn.arg_names
    const = {p.name for p in fn.params if p.is_constexpr}
    vals = dict(zip(names, args))
    opts = {}
    for k, v in kw.items():
        (opts if k in _OPTS else vals)[k] = v
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(names):
        v = vals[n] if n in vals else fn.params[i].default
        if n in const:
            sig[n] = "constexpr"
            consts[(i,)] = v
        elif isinstance(v, torch.Tensor):
            sig[n] = "*" + _TT[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[n] = "i1"
        elif isinstance(v, int):
            do_not = n in getattr(fn, "do_not_specialize", ()) or i in getattr(fn, "do_not_specialize", ())
            if v == 1 and not do_not:
                sig[n] = "constexpr"
                consts[(i,)] = 1
            else:
                sig[n] = "i32"
                if v % 16 == 0 and not do_not:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32"
    src = (GluonASTSource(fn, sig, constexprs=consts, attrs=attrs) if isinstance(fn, GluonJITFunction)
           else ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs))
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return k, opts


def _regs(cubin: bytes) -> str:
    import subprocess
    import tempfile

    from triton.tools.disasm import path_to_cuobjdump

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([path_to_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return m.group(1) if m else "?"


def loop_body(sass: str) -> list[str]:
    """Instructions of the innermost loop with tensor-core instructions (the main loop; else the
    innermost loop): from a label to the last backward branch to it (Triton's disassembly names
    branch targets LBBn). A split call's chunk fold after the main loop is a smaller loop of loads
    and additions, not the one measured."""
    lines = sass.splitlines()
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+(LBB\d+)", ln)
        if not m:
            continue
        for j in range(i):
            if lines[j].strip().startswith(m.group(1) + ":") and i - j > 2:
                loops.append((j, i))
    if not loops:
        return []
    mma = [lp for lp in loops if any(re.search(r"\b(IMMA|HMMA)\b", ln) for ln in lines[lp[0]:lp[1] + 1])]
    best = min(mma or loops, key=lambda lp: lp[1] - lp[0])
    return [ln for ln in lines[best[0] + 1:best[1] + 1] if ";" in ln]


def _matmul_launch(a):
    """The split or v3 launch of one random weight of format a.fmt."""
    from muser.engine.weights import repack, random_bytes
    from muser.gguf.types import GgmlType as G

    fmt = G[a.fmt]
    from muser.engine import nvfp4 as nv

    if fmt in nv.NVFP4_FORMATS:
        payload, sc, s2 = nv.random_bytes(fmt, a.n_out, a.n_in, 1)
        extra = (torch.from_numpy(sc), s2) if sc is not None else ()
        w = repack("t", fmt, a.n_out, a.n_in, torch.from_numpy(payload), *extra)
    else:
        w = repack("t", fmt, a.n_out, a.n_in, torch.from_numpy(random_bytes(fmt, a.n_out, a.n_in, 1)))
    x = torch.zeros(a.T, a.n_in)
    cfg = tuple(int(v) for v in a.config.split(",")) if a.config else None
    if a.kernel == "split":
        from muser.engine.kernels import qgemm_split as mod
        ws, act = mod.pack(w), mod.split_act_ref(x)
        rk = None if a.rows_kernel is None else bool(a.rows_kernel)
        fn, args, kw, grid = capture(lambda: mod.launch_matmul(ws, act, torch.empty(a.T, a.n_out), cfg, rk))
    elif a.kernel in ("tile", "ring"):
        from muser.engine.kernels import qmatmul_i8, qtile_i8
        act = qmatmul_i8.Act(G.Q8_K, torch.zeros(a.T, a.n_in, dtype=torch.int8), torch.zeros(a.T, a.n_in // 256),
                             torch.zeros(a.T, a.n_in // 32, dtype=torch.int32))
        split = False if a.walk else None
        if a.kernel == "ring":
            fn, args, kw, grid = capture(lambda: qtile_i8.matmul_ring(w, act, torch.empty(a.T, a.n_out),
                                                                       cfg or (64, 16, 4, 4), split, a.group,
                                                                       stream=a.stream, programs=a.programs), 0)
        else:
            fn, args, kw, grid = capture(lambda: qtile_i8.matmul_tile(w, act, torch.empty(a.T, a.n_out), cfg, split), 0)
    else:
        from muser.engine.kernels import qmatvec_v3 as mod
        w3 = mod.pack(w)
        fn, args, kw, grid = capture(lambda: mod.matvec_v3(w3, x, torch.empty(a.T, a.n_out), config=cfg, rt=a.rt))
    return fn, args, kw, grid


def _attn_call(kind: str, T: int, f16: bool = False) -> None:
    """A graph-shaped attention call of T rows (full geometry heads) at depth 32,768: full layers
    on a head-major plane, sliding ones on a token-major ring, as the engine lays them out."""
    from muser.engine.kernels import attention as att

    H, KV, D, W = 32, 2, 128, (2048 if kind == "sliding" else 0)
    cap = 2048 if W else 32768 + 64
    kp = torch.zeros((cap, KV * D) if W else (KV, cap, D), dtype=torch.float16)
    meta = torch.tensor(att.plane_meta(kp, kp, not W, KV, D, 32768 - (cap if W else 0), 0, cap if W else 32768))
    sc = att.AttnScratch(T, H, D, att.split_count(T, cap, W), "cpu")
    att.attend_triton(torch.zeros(T, H, D), torch.zeros(T, KV, D, dtype=torch.float16),
                      torch.zeros(T, KV, D, dtype=torch.float16), not W, meta, torch.tensor([32768]),
                      W, 0.1, sc, rows_bound=cap, f16_operands=f16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=["v3", "split", "tile", "ring", "attn"])
    ap.add_argument("fmt")
    ap.add_argument("T", type=int)
    ap.add_argument("--n-out", type=int, default=4096)
    ap.add_argument("--n-in", type=int, default=6656)
    ap.add_argument("--config", default=None, help="comma list passed as the launcher's config")
    ap.add_argument("--rows-kernel", type=int, choices=[0, 1], default=None,
                    help="split: force the CUDA-core kernel (1) or the tiles (0)")
    ap.add_argument("--rt", type=int, default=None, help="v3: activation rows a program takes (several-row path)")
    ap.add_argument("--walk", action="store_true", help="tile / ring: each program walking its chunks (split off)")
    ap.add_argument("--group", type=int, default=1, help="ring: the chunks a split program sums (each its own partial)")
    ap.add_argument("--stream", type=int, default=0, help="ring --walk: the stream-K walk, programs an SM")
    ap.add_argument("--programs", type=int, default=None, help="ring --walk: the stream-K walk on this many programs")
    ap.add_argument("--pdl", action="store_true", help="compile the launch as a GPU launch takes it: with PDL "
                    "(engine/kernels/gdc.py)")
    ap.add_argument("--attn-pass", type=int, choices=[0, 1, 2], default=0,
                    help="attn: the exact pass (0) or the f16 passes' statistics (1) or probabilities x V (2)")
    ap.add_argument("--dump", action="store_true")
    ap.add_argument("--grep", default=None, help="also print the whole kernel's instructions matching this regex")
    a = ap.parse_args(argv)
    if a.pdl:
        from muser.engine.kernels import gdc

        gdc.launch = lambda t: True
    if a.kernel == "attn":  # fmt: full | sliding; f16 planes of the full geometry; launches: partial, reduce (x2 f16)
        f16 = a.attn_pass > 0
        fn, args, kw, grid = capture(lambda: _attn_call(a.fmt, a.T, f16), 2 * (a.attn_pass - 1) if f16 else 0)
    else:
        fn, args, kw, grid = _matmul_launch(a)
    k, opts = compile_like_jit(fn, args, kw)
    sass = get_sass(k.asm["cubin"])
    body = loop_body(sass)
    ops = Counter(re.search(r"\t(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln).group(1).split(".")[0] for ln in body)
    print(f"{a.kernel} {a.fmt} T={a.T} regs={_regs(k.asm['cubin'])} "
          f"shared={k.metadata.shared} opts={opts} grid={grid} loop={len(body)} instr, "
          f"kernel={sum(1 for ln in sass.splitlines() if ';' in ln)} instr, "
          f"local={'STL' in sass}")
    print("  " + ", ".join(f"{o}:{c}" for o, c in ops.most_common()))
    if a.kernel in ("tile", "ring"):  # one loop iteration: one 256-block of BN weight rows, BN / num_warps a warp
        per_warp = kw["BN"] // kw["num_warps"] * 256
        print(f"  {len(body) / per_warp:.4f} warp-instructions a weight for {kw['BM']} activation rows "
              f"(IMMA {ops['IMMA']}, shared memory {k.metadata.shared} B)")
    if a.dump:
        print("\n".join(body))
    if a.grep:
        print("\n".join(ln.split("\t")[-1].strip() for ln in sass.splitlines() if ";" in ln and re.search(a.grep, ln)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
