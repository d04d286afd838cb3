"""`muser bench quant`: quantize and dequantize throughput of every weight format, per core.

Each format runs on the same f32 matrix (Gaussian, 0.02 std). Cells are interleaved A B A B
(run_interleaved: warm-up, then --reps counted repetitions). Throughput is MB/s of f32 values
(4 bytes per element) processed by one process; the codecs are numpy elementwise code on one
thread (no BLAS), so the figure is per core. The receipt also carries bits per weight and the
round-trip relative RMSE on Gaussian and Student-t(3) data.

Gate: the benchmarked bytes are compared with the pinned ggml (ggml_quantize_chunk through
ctypes, from llama-cpp-python==0.3.36) for every ggml format, and dequantized bit-exactly
against ggml's to_float; Muser's native NVFP4 is checked against the book's 7.2 fixture row.
The gate passes only if every comparison is identical.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quant", help="quantize/dequantize throughput (MB/s per core) of every format")
    p.add_argument("--rows", type=int, default=512, help="matrix rows (default 512)")
    p.add_argument("--cols", type=int, default=4096, help="row length, a multiple of 256 (default 4096)")
    p.add_argument("--reps", type=int, default=5, help="counted repetitions per cell (default 5)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--formats", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--out-dir", default=None, help="receipt directory (default: the per-user cache, muser.api.cache_dir()/receipts; give bench/receipts for the project's evidence)")
    p.set_defaults(func=run)


def _ggml_gate(x, formats) -> dict:
    """Byte/bit identity against the compiled ggml for the benchmarked data."""
    import ctypes
    from pathlib import Path

    import numpy as np

    import llama_cpp

    from ...quant import dequantize, dequantize_nvfp4, quantize
    from ...quant.quality import GGML_TYPE

    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"))
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]

    class Traits(ctypes.Structure):
        _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                    ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                    ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                    ("from_float_ref", ctypes.c_void_p)]

    base.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
    base.ggml_get_type_traits.argtypes = [ctypes.c_int]
    to_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    out: dict = {}
    rows, n = x.shape
    for fmt in formats:
        if fmt == "nvfp4":
            packed = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], np.uint8)
            row = dequantize_nvfp4(packed, np.array([[0x38]], np.uint8), np.float32(0.25))[0]
            want = [0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5, -0.0, -0.125, -0.25, -0.375, -0.5, -0.75, -1.0, -1.5]
            out[fmt] = {"check": "book 7.2 fixture row", "identical": row.tolist() == want}
            continue
        t = int(GGML_TYPE[fmt])
        ref = np.zeros((rows, base.ggml_row_size(t, n)), np.uint8)
        base.ggml_quantize_chunk(t, x.ctypes.data, ref.ctypes.data, 0, rows, n, None)
        ours = np.ascontiguousarray(quantize(x, GGML_TYPE[fmt])).view(np.uint8).reshape(rows, -1)
        same_q = bool(np.array_equal(ours, ref))
        y_ref = np.empty(rows * n, np.float32)
        to_float_t(base.ggml_get_type_traits(t).contents.to_float)(ref.ctypes.data, y_ref.ctypes.data, rows * n)
        y = dequantize(ref.reshape(-1), GGML_TYPE[fmt], rows * n)
        same_d = bool(np.array_equal(y.view(np.uint32), y_ref.view(np.uint32)))
        out[fmt] = {"check": "ggml_quantize_chunk bytes + to_float bits", "identical": same_q and same_d,
                    "quantize_identical": same_q, "dequantize_identical": same_d}
    return out


def run(args: argparse.Namespace) -> int:

    from ...errors import MuserError
    from ...quant.quality import FORMATS, bits_per_weight, relative_rmse, sample_data
    from ..receipt import device_description, run_interleaved, write_receipt

    formats = list(FORMATS) if args.formats is None else [s.strip() for s in args.formats.split(",")]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise MuserError(f"unknown format(s) {bad} (known: {', '.join(FORMATS)})")
    if args.cols <= 0 or args.cols % 256 or args.rows <= 0 or args.reps < 1:
        raise MuserError(f"--cols must be a positive multiple of 256 and --rows/--reps positive, "
                         f"got rows {args.rows}, cols {args.cols}, reps {args.reps}")
    x = sample_data("gaussian", args.rows, args.cols, seed=0)
    gate_detail = _ggml_gate(x, formats)
    payloads = {f: FORMATS[f][0](x) for f in formats}
    fns = {}
    for f in formats:
        enc, dec = FORMATS[f]
        fns[f"quantize/{f}"] = (lambda enc=enc: enc(x))
        fns[f"dequantize/{f}"] = (lambda dec=dec, p=payloads[f]: dec(p))
    cells = run_interleaved(fns, reps=args.reps, warmup=args.warmup)
    mb = x.size * 4 / 1e6
    tails = {k: sample_data(k, 64, args.cols, seed=1) for k in ("gaussian", "student_t3")}
    results = {}
    for f in formats:
        q, d = cells[f"quantize/{f}"], cells[f"dequantize/{f}"]
        results[f] = {
            "bits_per_weight": bits_per_weight(f),
            "quantize_MBps_per_core": mb / q.mean, "quantize_cv": q.cv,
            "dequantize_MBps_per_core": mb / d.mean, "dequantize_cv": d.cv,
            "rmse_rel_gaussian": relative_rmse(f, tails["gaussian"]),
            "rmse_rel_student_t3": relative_rmse(f, tails["student_t3"]),
        }
    ok = all(v["identical"] for v in gate_detail.values())
    path = write_receipt(
        "quant", model=None, device=device_description("cpu"), lane=None,
        gate={"status": "pass" if ok else "fail", "rule": "codec bytes/bits identical to the pinned ggml",
              "checks": gate_detail},
        results={"matrix": [args.rows, args.cols], "f32_MB": mb, "threads": 1,
                 "unit": "MB/s of f32 values per core", "formats": results},
        cells=cells, out_dir=args.out_dir,
    )
    print(f"{'format':<11} {'bpw':>7} {'quant MB/s':>11} {'cv':>6} {'dequant MB/s':>13} {'cv':>6} {'rmse gauss':>11} {'rmse t3':>9}")
    for f, r in results.items():
        print(f"{f:<11} {r['bits_per_weight']:>7.4f} {r['quantize_MBps_per_core']:>11.1f} {r['quantize_cv']:>6.1%} "
              f"{r['dequantize_MBps_per_core']:>13.1f} {r['dequantize_cv']:>6.1%} "
              f"{r['rmse_rel_gaussian']:>11.5f} {r['rmse_rel_student_t3']:>9.5f}")
    print(f"gate {'pass' if ok else 'FAIL'}; receipt {path}")
    return 0 if ok else 1
