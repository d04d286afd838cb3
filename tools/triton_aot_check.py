#!/usr/bin/env python3
"""Compile every Triton kernel of the engine for an NVIDIA target (default sm_90, the H200)
without a GPU: the launches are driven through the real host code (matvec v1/v3 for every
format and row bucket, v3 under every shipped tuning config, dequant, the integer-lane GEMM and
its activation quantizers (alone and in the fused tails), attention and the graph step's K/V rounding and stores for both plane kinds and KV dtypes) with CPU tensors,
each launch is recorded instead of run, and each distinct (kernel, signature, constexprs,
options) is compiled by Triton down to a cubin with the bundled ptxas.

This catches the errors the Triton interpreter cannot (type unification across if/else,
constexpr misuse, layout and dot-shape constraints, register spills that fail to compile)
before any GPU time is spent.

    python3 tools/triton_aot_check.py [--arch 90] [--json OUT.json]

Exit status 0 when every kernel compiled; 1 otherwise (each failure printed with its error).
Must run without TRITON_INTERPRET set (the kernels must be JITFunctions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("triton_aot_check: unset TRITON_INTERPRET (kernels must be compiled, not interpreted)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_TT = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
       torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "launch_pdl")
# PDL kernels (engine/kernels/gdc.py) may read only these arguments before their wait: weights,
# and the attention step's metadata and first position, which the host uploads before the step and
# no kernel writes (the partial kernel decides from them whether its split holds a visible key; the
# K/V storage whose addresses they hold is read after the wait: pdl_order refuses a load through a
# value loaded before it)
PRE_WAIT_READS = {"_matvec_v3_kernel": {"qp", "hp", "sp", "dp"}, "_attn_partial": {"meta", "pos"}}


def pdl_order(ptx: str, name: str, arg_names: list[str], scalars: frozenset[str] = frozenset()) -> str | None:
    """None when the PTX of a PDL kernel waits (griddepcontrol.wait) before every global store, async
    copy and atomic, and before every load whose address derives from a pointer argument other
    than PRE_WAIT_READS[name] or from a value loaded before the wait; else what comes first. `arg_names` are the kernel's non-constexpr
    arguments in order (the PTX parameters), `scalars` those of them that are not pointers
    (launch values, which no kernel writes)."""
    lines = [re.sub(r"^@!?%\w+\s+", "", ln.strip()) for ln in ptx.splitlines()]  # predicates off
    wait = next((i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")), None)
    if wait is None:
        return "no griddepcontrol.wait"
    allowed = PRE_WAIT_READS.get(name, set()) | scalars
    tainted: set[str] = set()
    for ln in lines[:wait]:
        op = ln.split()[0] if ln.split() else ""
        regs = re.findall(r"%[a-z]+\d+", ln)
        # a store to shared memory stays inside the program (a reduction across its warps), so
        # it may come first; global stores, async copies (a global read) and atomics may not
        if op.startswith(("st.", "cp.async", "atom.", "red.")) and ".param" not in op and not op.startswith("st.shared"):
            return f"before the wait: {ln}"
        if op.startswith("ld.param"):
            m = re.search(r"_param_(\d+)", ln)
            k = int(m.group(1)) if m else -1
            if regs and not (0 <= k < len(arg_names) and arg_names[k] in allowed):
                tainted.add(regs[0])
            continue
        if not regs:
            continue
        dest = re.match(r"\S+\s+(\{[^}]*\}|%[a-z]+\d+)", ln)
        outs = set(re.findall(r"%[a-z]+\d+", dest.group(1))) if dest else set()
        ins = [r for r in regs if r not in outs]
        if op.startswith("ld.global") and any(r in tainted for r in ins):
            return f"before the wait: {ln}"
        # a value loaded before the wait may itself be an address (the attention metadata holds
        # the K/V storage's): memory reached through it is read only after the wait
        if op.startswith("ld.global") or any(r in tainted for r in ins):
            tainted |= outs
    return None


def resources(cubin: bytes) -> dict:
    """Registers a thread and stack bytes of a compiled kernel, from the cubin by the cuobjdump that
    ships with Triton (`-res-usage`): the spill check a GPU's `n_regs` gives only once loaded. An
    empty dict when that cuobjdump is absent or prints no usage line."""
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    reg, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return {"registers": int(reg.group(1)), "stack_bytes": int(stack.group(1))} if reg and stack else {}


class Recorder:
    def __init__(self):
        self.launches: dict[tuple, tuple] = {}

    def run(self, fn: JITFunction, args, kwargs) -> None:
        names = fn.arg_names
        const_names = {p.name for p in fn.params if p.is_constexpr}
        dns = set(getattr(fn, "do_not_specialize", None) or ())
        sig, consts, opts = {}, {}, {}
        vals = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in names:
                vals[k] = v
            elif k in _OPTIONS:
                opts[k] = v
            elif k not in ("grid", "warmup"):
                raise TypeError(f"{fn.__name__}: unknown launch keyword {k!r}")
        for i, n in enumerate(names):
            if n not in vals:
                p = fn.params[i]
                if p.default is p.default.__class__.__mro__[-1] or p.default is None:
                    raise TypeError(f"{fn.__name__}: argument {n!r} missing")
                vals[n] = p.default
            v = vals[n]
            if n in const_names:
                sig[n] = "constexpr"
                consts[(i,)] = v
            elif isinstance(v, torch.Tensor):
                sig[n] = "*" + _TT[v.dtype]
            elif isinstance(v, bool):
                sig[n] = "i1"
            elif isinstance(v, int) and v == 1 and i not in dns and n not in dns:
                # the JIT specializes an int equal to 1 into constexpr 1 (triton/runtime/jit.py)
                sig[n] = "constexpr"
                consts[(i,)] = 1
            elif isinstance(v, int):
                sig[n] = "i32" if -(2**31) <= v < 2**31 else "i64"
            elif isinstance(v, float):
                sig[n] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: argument {n!r} of type {type(v).__name__}")
        # as the JIT specializes a launch (triton/runtime/jit.py): a 16-byte-aligned pointer and an
        # int divisible by 16 (outside do_not_specialize) compile with that divisibility, which is
        # what lets the compiler vectorize loads and pipeline them (cp.async); without it the PTX
        # is not the device's
        attrs = {}
        for i, n in enumerate(names):
            v = vals[n]
            if n in dns or i in dns or sig[n] == "constexpr":
                continue
            if (isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0) or (
                    sig[n] in ("i32", "i64") and not isinstance(v, bool) and v % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
        # the specialization is part of the variant: a kernel launched both aligned and not (a row
        # slice at an odd offset) is two compiles on the device, so two here
        key = (fn.__name__, tuple(sig.items()), tuple(sorted(consts.items())), tuple(sorted(opts.items())),
               tuple(sorted(attrs)))
        self.launches.setdefault(key, (fn, sig, consts, opts, attrs))


def drive(rec: Recorder) -> None:
    """Run the host side of every kernel launch the engine makes, on CPU tensors."""
    from muser.engine.kernels import attention as att
    from muser.engine.kernels import qmatvec as q1
    from muser.engine.weights import BASE_FORMATS, random_bytes, repack

    from muser.engine.kernels import qmatvec_v3 as q3
    for fmt in BASE_FORMATS:
        n_out, n_in = 24, 512
        w = repack("t", fmt, n_out, n_in, torch.from_numpy(random_bytes(fmt, n_out, n_in, 1).copy()))
        q1.dequant_triton(w)
        p3 = q3.pack(w) if q3.supports(fmt) else None
        if p3 is not None:
            q3.dequant_v3(p3)
            q3.dequant_v3(p3, bn=4, j=8)
            for T in (1, 2, 3, 5, 9, 16):
                q3.matvec_v3(p3, torch.zeros(T, n_in), torch.empty(T, n_out))
            q3.matvec_v3(p3, torch.zeros(16, n_in), torch.empty(16, n_out), rt=4)  # the other rows a program
            for (f, rows, _, _), cfg in q3.TUNED.items():
                if f == fmt.name:
                    q3.matvec_v3(p3, torch.zeros(rows, n_in), torch.empty(rows, n_out), config=cfg)
        for T in (1, 2, 3, 5, 9, 16):
            q1.matvec_triton(w, torch.zeros(T, n_in), torch.empty(T, n_out))
    from muser.engine import nvfp4 as nv
    from muser.engine.kernels import nvfp4 as knv

    for fmt in nv.NVFP4_FORMATS:
        n_out, n_in = 24, 512
        payload, sc, s2 = nv.random_bytes(fmt, n_out, n_in, 1)
        extra = (torch.from_numpy(sc), s2) if sc is not None else ()
        w = repack("t", fmt, n_out, n_in, torch.from_numpy(payload), *extra)
        knv.dequant_nvfp4_triton(w)
        for T in (1, 2, 3, 5, 9, 16):
            knv.matvec_nvfp4(w, torch.zeros(T, n_in), torch.empty(T, n_out))
        p3 = q3.pack(w)  # the decode path's layout for NVFP4 (qmatvec_v3 FMT 8 / 9)
        q3.dequant_v3(p3)
        q3.dequant_v3(p3, bn=4, j=8)
        for T in (1, 2, 3, 5, 9, 16):
            q3.matvec_v3(p3, torch.zeros(T, n_in), torch.empty(T, n_out))
        q3.matvec_v3(p3, torch.zeros(16, n_in), torch.empty(16, n_out), rt=2)
    from muser.engine.kernels import qmatmul_i8 as i8

    for fmt in i8.FORMATS:  # the integer lane: decode (BM 16, narrow and wide N), verify, prefill tiles
        for n_in, n_out in ((512, 24), (512, 4096), (2560, 256)):  # 2560: several chunks, the chunk-sum launch
            w = repack("t", fmt, n_out, n_in, torch.from_numpy(random_bytes(fmt, n_out, n_in, 1).copy()))
            for T in (1, 16, 17, 512):
                i8.matmul_i8(w, torch.zeros(T, n_in), torch.empty(T, n_out))
        for cfg in ((16, 16, 4, 1), (64, 32, 4, 2), (128, 64, 8, 2)):  # sweep corners (< 227 KB shared)
            i8.matmul_i8(w, torch.zeros(64, n_in), config=cfg)
    from muser.engine.kernels import qtile_i8 as ti
    from muser.gguf.types import GgmlType as G

    for fmt in ti.FORMATS:  # the integer lane's K-quant tile: decode, verify, prefill buckets, split and walked chunks
        for n_in, n_out in ((512, 24), (2560, 136)):
            w = repack("t", fmt, n_out, n_in, torch.from_numpy(random_bytes(fmt, n_out, n_in, 1).copy()))
            for T, cfg, split in ((1, None, None), (16, None, None), (17, None, None), (1, (64, 8, 4, 1), None),
                                  (17, (64, 16, 4, 1), None), (1, None, False), (1, (64, 8, 4, 1), False)):
                ti.matmul_tile(w, i8.Act(G.Q8_K, torch.zeros(T, n_in, dtype=torch.int8), torch.zeros(T, n_in // 256),
                                         torch.zeros(T, n_in // 32, dtype=torch.int32)), torch.empty(T, n_out), cfg,
                               split)
            for T, rcfg, split, group in ((1, (32, 8, 2, 4), None, 1), (16, (64, 16, 4, 4), None, 1),
                                          (16, (64, 16, 4, 6), False, 1), (512, (128, 16, 4, 3), False, 1),
                                          (1, (32, 8, 2, 4), None, 4), (16, (64, 16, 4, 4), None, 2)):
                # its ring variant, split (a program a chunk or a group of chunks) and walked
                ti.matmul_ring(w, i8.Act(G.Q8_K, torch.zeros(T, n_in, dtype=torch.int8), torch.zeros(T, n_in // 256),
                                         torch.zeros(T, n_in // 32, dtype=torch.int32)), torch.empty(T, n_out), rcfg,
                               split, group)
            for T, rcfg, stream in ((16, (64, 16, 4, 4), 3), (16, (64, 16, 4, 4), 2), (16, (32, 16, 2, 3), 6),
                                    (1, (64, 16, 4, 4), 3), (1, (32, 8, 2, 4), 6)):
                # its stream-K walk (programs an SM: the register cap each gives)
                ti.matmul_ring(w, i8.Act(G.Q8_K, torch.zeros(T, n_in, dtype=torch.int8), torch.zeros(T, n_in // 256),
                                         torch.zeros(T, n_in // 32, dtype=torch.int32)), torch.empty(T, n_out), rcfg,
                               False, stream=stream, programs=2)
    from muser.engine.kernels import qgemm_split as sg

    for fmt in sg.FORMATS:  # the exact lane's K-quant GEMM: the CUDA-core rows, the 16-row and wide tiles
        n_out, n_in = 24, 1280
        p = sg.pack(repack("t", fmt, n_out, n_in, torch.from_numpy(random_bytes(fmt, n_out, n_in, 1).copy())))
        for T in (1, 2, 3, 16, 17, 512):
            sg.launch_split_act(torch.zeros(T, n_in))
            act = sg.Act(torch.zeros(T, sg.PARTS, n_in, dtype=torch.int8), torch.zeros(T, n_in // 256),
                         torch.zeros(T, n_in // 16, dtype=torch.float64), torch.zeros(T, n_in // 32, dtype=torch.float64))
            sg.launch_matmul(p, act, torch.empty(T, n_out))
    from muser.engine.kernels import fused

    for R, N in ((1, 6656), (16, 6656), (4, 512)):
        x = torch.zeros(R, N)
        fused.norm_mul(x, torch.ones(N), 1e-5)
        fused.norm_mul(x, torch.ones(N), 1e-8, res=x)
        fused.gate_mul(x, x)
        fused.silu_mul(x, x)
        fused.norm2(x, torch.ones(N), 1e-8, x, torch.ones(N), 1e-5)
        for kind in i8.KINDS:  # the integer lane: the tails also write the projections' activations
            fused.norm_mul(x, torch.ones(N), 1e-5, act=i8.Act.empty(kind, R, N, "cpu"))
            fused.norm2(x, torch.ones(N), 1e-8, x, torch.ones(N), 1e-5, act=i8.Act.empty(kind, R, N, "cpu"))
            fused.gate_mul(x, x, act=i8.Act.empty(kind, R, N, "cpu"))
            fused.silu_mul(x, x, act=i8.Act.empty(kind, R, N, "cpu"))
    for T in (1, 16):
        y = torch.zeros(T, 8704)
        cs = torch.zeros(T, 64)
        fused.qk_norm_rope(y, 0, 4096, 32, 2, 128, torch.ones(128), torch.ones(128), 1e-5, cs, cs)
        fused.qk_norm_rope(y, 0, 4096, 32, 2, 128, torch.ones(128), torch.ones(128), 1e-5, None, None)
    H, n_kv, D = 32, 2, 128
    for hm in (False, True):  # the engine's planes: token-major sliding rings, head-major full planes
        for dt in (torch.float16, torch.float32):
            for T in (1, 16, 512):  # decode, verify, a prefill chunk (row groups)
                cap, win = (32768, 0) if hm else (2048, 2048)
                q = torch.zeros(T, H, D)
                kn = torch.zeros(T, n_kv, D, dtype=dt)
                shape = (n_kv, cap, D) if hm else (cap, n_kv * D)
                kp = torch.zeros(shape, dtype=dt)
                meta = torch.tensor(att.plane_meta(kp, kp, hm, n_kv, D, 0, 0, 100), dtype=torch.int64)
                pos = torch.tensor([100], dtype=torch.int64)
                rows = min(T, 16)
                sc = att.AttnScratch(rows, H, D, att.split_count(rows, cap, win), "cpu")
                for f16ops in (False, True) if dt == torch.float16 else (False,):  # the fast lane's f16 dots
                    att.attend_triton(q, kn, kn, hm, meta, pos, win, 0.0883883, sc,
                                      rows_bound=100 if T > 16 else cap, f16_operands=f16ops)
                if T <= 16:  # a graph step's K/V tail: rounding, then both planes' stores
                    kf = torch.zeros(T, n_kv, D)
                    kq, vq = att.kv_round(kf, kf, dt)
                    att.kv_store(kq, vq, meta, torch.zeros(T, dtype=torch.int64), hm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rec = Recorder()
    orig = JITFunction.run
    if a.arch >= 90:  # the launches as a GPU of that generation takes them: with PDL
        from muser.engine.kernels import gdc

        gdc.launch = lambda t: True

    def fake_run(self, *args, grid=None, warmup=False, **kwargs):
        rec.run(self, args, kwargs)

    JITFunction.run = fake_run
    try:
        drive(rec)
    finally:
        JITFunction.run = orig
    # gluon loads only here: its import needs Triton's standard library compiled, not interpreted
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    target = GPUTarget("cuda", a.arch, 32)
    results, bad = [], 0
    t0 = time.time()
    for (name, sig, consts, opts, _), (fn, s, c, o, at) in rec.launches.items():
        t = time.time()
        try:
            src = (GluonASTSource(fn, s, constexprs=c, attrs=at) if isinstance(fn, GluonJITFunction)
                   else ASTSource(fn, signature=s, constexprs=c, attrs=at))
            k = triton.compile(src, target=target, options=dict(o))
            meta = getattr(k, "metadata", None)
            r = {"kernel": name, "constexprs": {fn.arg_names[i[0]]: v for i, v in c.items()}, "options": o,
                 "ok": True, **resources(k.asm["cubin"]), "shared": getattr(meta, "shared", None),
                 "seconds": round(time.time() - t, 2)}
            if o.get("launch_pdl"):
                args = [n for n in fn.arg_names if s.get(n) != "constexpr"]
                r["pdl_order"] = pdl_order(k.asm["ptx"], name, args,
                                           frozenset(n for n in args if not s[n].startswith("*")))
                if r["pdl_order"] is not None:
                    bad += 1
                    r["ok"] = False
                    print(f"FAIL {name} {r['constexprs']} {o}: PDL order: {r['pdl_order']}", flush=True)
        except Exception as e:  # record every failure, keep going
            bad += 1
            r = {"kernel": name, "constexprs": {fn.arg_names[i[0]]: v for i, v in c.items()}, "options": o,
                 "ok": False, "error": f"{type(e).__name__}: {e}"[-1500:]}
            print(f"FAIL {name} {r['constexprs']} {o}\n{r['error']}\n", flush=True)
        results.append(r)
    print(f"{len(results)} kernel variants compiled for sm_{a.arch} in {time.time() - t0:.0f} s, {bad} failed")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
