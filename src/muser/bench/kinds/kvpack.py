"""`muser bench kvpack`: time to first token cold vs warm (kvpack restore + suffix prefill).

For each prompt length P: a store is primed with one run, then "cold/P" (fresh session, full
prefill, first greedy token) and "warm/P" (fresh session over the store: restore the longest
stored prefix, prefill the rest, first greedy token) are timed interleaved, A B A B. The gate:
the warm first-token logits are bitwise the cold ones and the greedy text of both runs is
identical (--gate-tokens tokens). Also recorded: bytes on disk per stored token against the
model's KV formula (MuseConfig.kv_bytes) and the entry files' size against the byte format's
formula (docs/kvpack.md: per entry a 48-byte header, the manifest padded to 8, and a tile of
64 + pad8(2 x layers) + payload + 32 bytes), both asserted by the gate; and restore bandwidth
(read + verify + install of the hit, and read + verify alone) with the entry files dropped from
the page cache first (posix_fadvise DONTNEED) and as cached, against the disk's read bandwidth:
a cold read of a fresh file in the same directory, written, fsynced and dropped from the page
cache before each read (mincore reports what stayed resident).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

TEXT = "def handle(self, request, *args, **kwargs):\n    if request.method == 'GET':\n" \
       "        return self.get(request, *args, **kwargs)\n    raise ValueError(request)\n\n"


def register(sub: argparse._SubParsersAction) -> None:
    from ..plot import add_plot_flag

    p = sub.add_parser("kvpack", help="TTFT cold vs warm kvpack restore, bytes per token, restore bandwidth",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF (default: the embedded default model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--lane", default="exact", help="exact | fast (default exact)")
    p.add_argument("--kv", default="f16", help="KV type: f16 | f32 (default f16)")
    p.add_argument("--lengths", default="600,1000", help="prompt lengths in tokens (default 600,1000)")
    p.add_argument("--reps", type=int, default=5, help="counted repetitions per cell (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up repetitions per cell (default 1)")
    p.add_argument("--gate-tokens", type=int, default=16, help="greedy tokens compared by the gate (default 16)")
    p.add_argument("--dir", default=None, help="kvpack directory (default: a fresh temporary one, removed)")
    p.add_argument("--out-dir", default=None, help="receipt directory (default bench/receipts)")
    add_plot_flag(p)
    p.set_defaults(func=run)


def _prompt(tok, n: int) -> list[int]:
    ids = tok.encode(TEXT, add_special=True)
    body = tok.encode(TEXT, add_special=False)
    while len(ids) < n:
        ids += body
    return ids[:n]


def _resident(path: Path) -> float | None:
    """Fraction of `path`'s pages in the page cache (mincore over a read-only mapping); None
    where the call is not available."""
    import ctypes
    import mmap

    size = path.stat().st_size
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def _drop(paths) -> list[float | None]:
    """Drop each (fsynced) file from the page cache; the fraction still resident after it."""
    out = []
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        out.append(_resident(Path(p)))
    return out


def _read_bandwidth(d: Path, nbytes: int) -> dict:
    """Cold read bandwidth of the disk under `d`: a fresh file of >= `nbytes` (random bytes,
    fsynced), dropped from the page cache before each of 3 timed reads."""
    path = d / "read-probe.bin"
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(max(1, -(-nbytes >> 20))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    size = path.stat().st_size
    samples, resident = [], []
    buf = bytearray(size)
    try:
        for _ in range(3):
            resident.append(_drop([path])[0])
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(buf)
            samples.append(size / (time.perf_counter() - t0))
            if got != size:
                raise OSError(f"read {got} of {size} bytes from {path}")
    finally:
        path.unlink()
    return {"bytes": size, "bytes_per_s": samples, "mean_bytes_per_s": float(np.mean(samples)),
            "resident_after_drop": resident,
            "rule": "fresh file in the store's directory, fsync, posix_fadvise DONTNEED, then one read(2) of it; "
                    "3 times"}


def _disk_formula(paths: list[Path], hit, layout) -> dict:
    """Entry files of `hit` against the byte format: header + padded manifest (read from each
    file) + KvLayout.tile_bytes of the tile's kind and rows (muser.kv.serial)."""
    from ...kvpack import read_manifest

    heads = []
    for p in paths:
        with open(p, "rb") as f:
            _, at = read_manifest(f.read())  # offset of the tile: 48 + manifest + padding
        heads.append(at)
    tiles = [layout.tile_bytes(t.kind, t.rows) for t in hit.tiles]
    return {"entry_heads_bytes": sum(heads), "tile_bytes": sum(tiles), "bytes": sum(heads) + sum(tiles)}


def run(args: argparse.Namespace) -> int:
    import muser

    from ...errors import ContextOverflow, LaneError
    from ...kv.serial import install_tiles
    from ..plot import check_plot_flag, plot_for_run
    from ..receipt import device_description, run_interleaved, write_receipt
    from ..speed import model_json

    check_plot_flag(args)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if not lengths or min(lengths) < 2 or args.reps < 1 or args.warmup < 0 or args.gate_tokens < 1:
        raise LaneError(f"--lengths {args.lengths!r} (each >= 2), --reps >= 1, --warmup >= 0, --gate-tokens >= 1")
    m = muser.load(args.model, device=args.device, lane=args.lane, kv=args.kv)
    tmp = None
    try:
        cfg = m.config
        too_long = [n for n in lengths if n + args.gate_tokens > cfg.context_length]
        if too_long:
            raise ContextOverflow(f"prompt lengths {too_long} + {args.gate_tokens} gate tokens exceed the "
                                  f"model's context_length {cfg.context_length}")
        d = Path(args.dir) if args.dir else Path(tmp := tempfile.mkdtemp(prefix="muser-kvpack-bench-"))
        tok = m.tokenizer
        fns, results, gates = {}, {}, {}
        for n in lengths:
            ids = _prompt(tok, n)
            n_ctx = n + args.gate_tokens
            prime = m.session(max_context=n_ctx, kvpack=d)
            prime.prefill(ids)
            prime.wait()
            store = prime.store
            expect = (n - 1) // store.binding.layout.chunk_tokens * store.binding.layout.chunk_tokens

            def cold(ids=ids, n_ctx=n_ctx):
                return int(np.argmax(m.session(max_context=n_ctx).prefill(ids)))

            def warm(ids=ids, n_ctx=n_ctx, expect=expect, store=store):
                s = m.session(max_context=n_ctx, kvpack=store)
                t = int(np.argmax(s.prefill(ids)))
                if s.last["restored"] != expect:
                    raise LaneError(f"warm run restored {s.last['restored']} tokens, expected {expect}")
                s.wait()
                return t

            fns[f"cold/{n}"], fns[f"warm/{n}"] = cold, warm
            # gate: bitwise first logits, identical greedy text
            sc, sw = m.session(max_context=n_ctx), m.session(max_context=n_ctx, kvpack=store)
            lc, lw = sc.prefill(ids), sw.prefill(ids)
            bitwise = bool(np.array_equal(lc, lw))
            delta = float(np.abs(lc - lw).max())
            tc, tw = [], []
            for _ in range(args.gate_tokens):
                tc.append(int(np.argmax(lc)))
                tw.append(int(np.argmax(lw)))
                if len(tc) < args.gate_tokens:
                    lc, lw = sc.decode(tc[-1]), sw.decode(tw[-1])
            sw.wait()
            text_c, text_w = tok.decode(tc), tok.decode(tw)
            gates[n] = {"restored": sw.last["restored"], "bitwise_first_logits": bitwise,
                        "max_abs_delta_first_logits": delta,
                        "greedy_ids_identical": tc == tw, "text_identical": text_c == text_w, "text": text_c}
            # restore bandwidth: read + verify + install (tile by tile, as the warm path does) of the
            # hit, 5 times with the entry files dropped from the page cache first (cold), 5 times as
            # cached (warm)
            hit = store.lookup(ids)
            paths = [next(d.rglob(nm)) for nm in hit.names]
            timed: dict[str, dict[str, list]] = {}
            for mode in ("cold", "warm"):
                t = timed[mode] = {"restore_s": [], "read_verify_s": [], "resident_after_drop": []}
                for _ in range(5):
                    if mode == "cold":
                        t["resident_after_drop"].append(max((r or 0.0) for r in _drop(paths)))
                    s = m.session(max_context=n_ctx)
                    t0 = time.perf_counter()
                    hit = store.lookup(ids)  # read + verify every entry of the prefix
                    t1 = time.perf_counter()
                    install_tiles(s, hit.tiles, store.binding.layout, hit.n_tokens)  # install
                    t["restore_s"].append(time.perf_counter() - t0)
                    t["read_verify_s"].append(t1 - t0)
            file_bytes = sum(p.stat().st_size for p in paths)
            payload = sum(2 * len(t.layers) * t.rows * store.binding.layout.row_bytes for t in hit.tiles)
            formula = cfg.kv_bytes(hit.n_tokens, 2 if args.kv == "f16" else 4)
            disk_formula = _disk_formula(paths, hit, store.binding.layout)
            results[n] = {
                "prompt_tokens": n, "stored_prefix_tokens": hit.n_tokens, "entries": len(paths),
                "bytes_on_disk": file_bytes, "bytes_on_disk_per_token": file_bytes / hit.n_tokens,
                "kv_payload_bytes": payload, "formula_kv_bytes": formula,
                "formula_kv_bytes_per_token": formula / hit.n_tokens,
                "payload_equals_formula": payload == formula,
                "disk_formula": disk_formula, "disk_equals_formula": file_bytes == disk_formula["bytes"],
                "overhead_bytes": file_bytes - payload,
            }
            for mode, t in timed.items():
                results[n][f"restore_{mode}"] = t | {
                    "restore_bytes_per_s": [file_bytes / x for x in t["restore_s"]],
                    "read_verify_bytes_per_s": [file_bytes / x for x in t["read_verify_s"]]}
        cells = run_interleaved(fns, reps=args.reps, warmup=args.warmup)
        disk = _read_bandwidth(d, max(16 << 20, 4 * max(r["bytes_on_disk"] for r in results.values())))
        for n in lengths:
            c, w = cells[f"cold/{n}"], cells[f"warm/{n}"]
            results[n].update({"ttft_cold_mean_s": c.mean, "ttft_cold_cv": c.cv, "ttft_warm_mean_s": w.mean,
                               "ttft_warm_cv": w.cv, "speedup": c.mean / w.mean})
            for mode in ("cold", "warm"):
                r = results[n][f"restore_{mode}"]
                r["restore_vs_disk_read"] = float(np.mean(r["restore_bytes_per_s"])) / disk["mean_bytes_per_s"]
                r["read_verify_vs_disk_read"] = float(np.mean(r["read_verify_bytes_per_s"])) / disk["mean_bytes_per_s"]
        ok = all(g["bitwise_first_logits"] and g["greedy_ids_identical"] and g["text_identical"]
                 for g in gates.values()) and all(r["payload_equals_formula"] and r["disk_equals_formula"]
                                                  for r in results.values())
        gate = {"status": "pass" if ok else "fail", "rule": "warm first-token logits bitwise equal to cold; "
                "identical greedy text; stored KV payload equals MuseConfig.kv_bytes; entry files' bytes equal "
                "the byte format's formula", "per_length": gates,
                "bytes": {n: {"payload_equals_formula": r["payload_equals_formula"],
                              "disk_equals_formula": r["disk_equals_formula"]} for n, r in results.items()}}
        path = write_receipt("kvpack", model=model_json(m), device=device_description(args.device), lane=args.lane,
                             gate=gate, results={"kv": args.kv, "lengths": results, "disk_read": disk},
                             cells=cells, out_dir=args.out_dir)
        for n in lengths:
            r = results[n]
            rc, rw = r["restore_cold"], r["restore_warm"]
            print(f"P={n}: TTFT cold {r['ttft_cold_mean_s'] * 1e3:.1f} ms, warm {r['ttft_warm_mean_s'] * 1e3:.1f} ms "
                  f"({r['speedup']:.2f}x, {r['stored_prefix_tokens']} restored); "
                  f"{r['bytes_on_disk_per_token']:.1f} B/token on disk (format formula: {r['disk_equals_formula']}), "
                  f"payload {r['formula_kv_bytes_per_token']:.0f} B/token == MuseConfig.kv_bytes: "
                  f"{r['payload_equals_formula']}; restore cold {np.mean(rc['restore_bytes_per_s']) / 1e9:.3f} GB/s "
                  f"(read + verify {np.mean(rc['read_verify_bytes_per_s']) / 1e9:.3f}), cached "
                  f"{np.mean(rw['restore_bytes_per_s']) / 1e9:.3f} GB/s vs cold disk read "
                  f"{disk['mean_bytes_per_s'] / 1e9:.3f} GB/s")
        print(f"gate: {gate['status']}; receipt {path}")
        plot_for_run(args, path)
        return 0 if ok else 1
    finally:
        m.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

