"""`muser bench kvpack`: time to first token cold vs warm (kvpack restore + suffix prefill).

Two modes, named in the receipt (results.mode):

* replay (--suffix-tokens 0, the default): the timed prompt of length P is the one that primed
  the store; the warm run restores up to the last 512-token boundary before its final token,
  L = floor((P-1)/512)*512, and prefills the rest (up to 512 tokens).
* new-question (--suffix-tokens Q > 0): a stored document followed by a new question. For each
  document length P the store is primed by P document tokens + a first question (so every
  complete chunk of the document is persisted, the SWA tail at B = floor(P/512)*512); the timed
  prompt is the same P document tokens + a different Q-token question. Warm restores B (all of
  P when P is a multiple of 512) and prefills the P - B + Q tokens after it, which must fit one
  chunk (so a warm run stores nothing new and every repetition restores the same B tokens).

Cold is a fresh session's full prefill of the timed prompt, first greedy token; warm a fresh
session over the store. Both start their prefill chunks at 0 or B, multiples of 512, so the
chunk boundaries are the same. The cells are timed interleaved, A B A B (`--reps 1 --warmup 0`
is valid: one sample per cell, recorded with a null CV). The gate, from the last timed cold and
warm sessions: the warm first-token logits are bitwise the cold ones (max |delta| recorded), the
greedy text of both is identical (--gate-tokens tokens) and the warm run restored exactly the
expected tokens. Also recorded: bytes on disk per stored token against the model's KV formula
(MuseConfig.kv_bytes) and the entry files' size against the byte format's formula
(docs/kvpack.md: per entry a 48-byte header, the manifest padded to 8, and a tile of
64 + pad8(2 x layers) + payload + 32 bytes), both asserted by the gate; and restore bandwidth
(Store.restore, the warm path's: read + verify on several threads, each tile installed as it
verifies; Store.lookup: read + verify alone; and lookup + install_tiles: the install after all the
reads) with the entry files dropped from the page cache first (posix_fadvise DONTNEED) and as
cached, against the disk's read bandwidth: a cold read of a fresh file in the same directory,
written, fsynced and dropped from the page cache before each read (mincore reports what stayed
resident).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TEXT = "def handle(self, request, *args, **kwargs):\n    if request.method == 'GET':\n" \
       "        return self.get(request, *args, **kwargs)\n    raise ValueError(request)\n\n"
# new-question mode: the question that primes the store, and the different one that is timed
PRIME_QUESTION = "# Q: which exception does handle raise, and when?\n"
QUESTION = "Explain what handle returns for a GET request and why.\n"
RESTORE_REPS = 5  # restore-bandwidth samples per page-cache state


def register(sub: argparse._SubParsersAction) -> None:
    from ..plot import add_plot_flag

    p = sub.add_parser("kvpack", help="TTFT cold vs warm kvpack restore, bytes per token, restore bandwidth",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF (default: the embedded default model)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--lane", default="exact", help="exact | fast (default exact)")
    p.add_argument("--kv", default="f16", help="KV type: f16 | f32 (default f16)")
    p.add_argument("--lengths", default="600,1000",
                   help="prompt lengths in tokens; with --suffix-tokens Q > 0 the document lengths P, the timed "
                        "prompt being P + Q (default 600,1000)")
    p.add_argument("--suffix-tokens", type=int, default=0, metavar="Q",
                   help="0: replay mode, the timed prompt is the priming one; Q > 0: new-question mode, the store "
                        "is primed with each document + a first question and the timed prompt is the document + a "
                        "different Q-token question (default 0)")
    p.add_argument("--reps", type=int, default=5, help="counted repetitions per cell (default 5; 1 is valid)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up repetitions per cell (default 1; 0 is valid)")
    p.add_argument("--gate-tokens", type=int, default=16, help="greedy tokens compared by the gate (default 16)")
    p.add_argument("--dir", default=None, help="kvpack directory (default: a fresh temporary one, removed)")
    p.add_argument("--out-dir", default=None, help="receipt directory (default bench/receipts)")
    add_plot_flag(p)
    p.set_defaults(func=run)


def _repeat(tok, text: str, n: int, add_special: bool) -> list[int]:
    """n token ids: `text` encoded (with BOS when add_special), then its body repeated."""
    ids = tok.encode(text, add_special=add_special)
    body = tok.encode(text, add_special=False)
    while len(ids) < n:
        ids += body
    return ids[:n]


def _prompt(tok, n: int) -> list[int]:
    return _repeat(tok, TEXT, n, add_special=True)


def plan(tok, n: int, q: int, ch: int) -> dict[str, Any]:
    """The priming prompt, the timed prompt and the tokens the warm run restores for length n.
    replay (q == 0): both prompts are n document tokens; restore floor((n-1)/ch)*ch.
    new-question: prime = document + a first question short enough that its last chunk boundary
    before the final token is B = floor(n/ch)*ch (so the store holds the document's chunks and the
    SWA tail at B, nothing of the question); timed = document + a different q-token question;
    restore B, the suffix [B, n + q) is one chunk at most."""
    doc = _prompt(tok, n)
    if q == 0:
        return {"mode": "replay", "prime": doc, "timed": doc, "restore": (n - 1) // ch * ch}
    b = n // ch * ch
    prime = doc + _repeat(tok, PRIME_QUESTION, min(q, b + ch - n), add_special=False)
    timed = doc + _repeat(tok, QUESTION, q, add_special=False)
    return {"mode": "new-question", "prime": prime, "timed": timed, "restore": b}


def _shared(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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


MODES = {
    "replay": "the timed prompt is the one that primed the store; warm restores its chunks up to the last "
              "512-token boundary before the final token and prefills the rest",
    "new-question": "the store is primed by each document + a first question; the timed prompt is the same "
                    "document + a different question; warm restores the document's complete chunks and prefills "
                    "the rest of the document and the question",
}


def _check_args(args: argparse.Namespace, lengths: list[int], ch: int) -> None:
    """Refuse flags that cannot make the measurement, by value, before the model loads."""
    from ...errors import LaneError

    q = args.suffix_tokens
    if not lengths or min(lengths) < 2 or args.reps < 1 or args.warmup < 0 or args.gate_tokens < 1 or q < 0:
        raise LaneError(f"--lengths {args.lengths!r} (each >= 2), --reps {args.reps} (>= 1), --warmup "
                        f"{args.warmup} (>= 0), --gate-tokens {args.gate_tokens} (>= 1), --suffix-tokens {q} (>= 0)")
    if q:
        short = [n for n in lengths if n < ch]
        if short:
            raise LaneError(f"--suffix-tokens {q}: document lengths {short} hold no complete {ch}-token chunk "
                            f"to restore")
        long = [n for n in lengths if n - n // ch * ch + q > ch]
        if long:
            raise LaneError(f"--suffix-tokens {q}: for document lengths {long} the tokens after the last {ch}-token "
                            f"boundary plus the question exceed one chunk ({ch}); the warm run would store new "
                            f"chunks and later repetitions would restore more")


def run(args: argparse.Namespace) -> int:
    import muser

    from ...errors import ContextOverflow, LaneError
    from ...kv.serial import CHUNK_TOKENS, install_tiles
    from ..plot import check_plot_flag, plot_for_run
    from ..receipt import device_description, run_interleaved, write_receipt
    from ..speed import model_json

    check_plot_flag(args)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise LaneError(f"--lengths {args.lengths!r} is not a comma-separated list of integers") from None
    _check_args(args, lengths, CHUNK_TOKENS)
    m = muser.load(args.model, device=args.device, lane=args.lane, kv=args.kv)
    tmp = None
    last: dict[str, tuple[Any, np.ndarray]] = {}  # cell -> (session, first logits) of its latest run
    try:
        cfg = m.config
        q = args.suffix_tokens
        too_long = [n for n in lengths if n + q + args.gate_tokens > cfg.context_length]
        if too_long:
            raise ContextOverflow(f"prompt lengths {too_long} + {q} suffix + {args.gate_tokens} gate tokens exceed "
                                  f"the model's context_length {cfg.context_length}")
        cuda = args.device.startswith("cuda")

        def sync() -> None:  # device work queued by an install is part of the restore it times
            if cuda:
                import torch

                torch.cuda.synchronize()

        d = Path(args.dir) if args.dir else Path(tmp := tempfile.mkdtemp(prefix="muser-kvpack-bench-"))
        tok = m.tokenizer
        fns, results, plans = {}, {}, {}
        restore_s: dict[str, list[float]] = {}  # warm cell -> seconds its restore took in each run (warm-ups first)
        store = None
        for n in lengths:
            pl = plans[n] = plan(tok, n, q, CHUNK_TOKENS)
            ids, expect = pl["timed"], pl["restore"]
            n_ctx = len(ids) + args.gate_tokens
            prime = m.session(max_context=max(n_ctx, len(pl["prime"])), kvpack=store if store is not None else d)
            prime.prefill(pl["prime"])
            prime.wait()
            store = prime.store
            del prime

            def cold(ids=ids, n_ctx=n_ctx, key=f"cold/{n}"):
                last.pop(key, None)
                s = m.session(max_context=n_ctx)
                logits = s.prefill(ids)
                last[key] = (s, logits)
                return int(np.argmax(logits))

            def warm(ids=ids, n_ctx=n_ctx, expect=expect, store=store, key=f"warm/{n}"):
                last.pop(key, None)
                s = m.session(max_context=n_ctx, kvpack=store)
                logits = s.prefill(ids)
                if s.last["restored"] != expect:
                    raise LaneError(f"warm run restored {s.last['restored']} tokens, expected {expect}")
                restore_s[key].append(s.last["restore_s"])
                last[key] = (s, logits)
                return int(np.argmax(logits))

            fns[f"cold/{n}"], fns[f"warm/{n}"] = cold, warm
            restore_s[f"warm/{n}"] = []
            # restore bandwidth, RESTORE_REPS times each with the entry files dropped from the page
            # cache first (cold) and as cached (warm): the warm path's restore (Store.restore: read +
            # verify on the store's threads, each tile installed as it verifies), read + verify alone
            # (Store.lookup), and the same reads with the install after them (lookup + install_tiles)
            hit = store.lookup(ids)
            if hit is None or hit.n_tokens != expect:
                raise LaneError(f"the primed store holds {hit.n_tokens if hit else 0} tokens of the timed prompt "
                                f"of length {len(ids)}, expected {expect}")
            paths = [next(d.rglob(nm)) for nm in hit.names]
            timed: dict[str, dict[str, list]] = {}
            for mode in ("cold", "warm"):
                t = timed[mode] = {"restore_s": [], "read_verify_s": [], "read_then_install_s": [],
                                   "resident_after_drop": []}
                for _ in range(RESTORE_REPS):
                    for key in ("restore_s", "read_verify_s", "read_then_install_s"):
                        if mode == "cold":
                            t["resident_after_drop"].append(max((r or 0.0) for r in _drop(paths)))
                        s = m.session(max_context=n_ctx)
                        sync()
                        t0 = time.perf_counter()
                        got = store.restore(s, ids) if key == "restore_s" else store.lookup(ids)
                        if key == "read_then_install_s" and got is not None:
                            install_tiles(s, got.tiles, store.binding.layout, got.n_tokens)
                        sync()
                        t[key].append(time.perf_counter() - t0)
                        if got is None or got.n_tokens != expect:
                            raise LaneError(f"{key[:-2]} found {got.n_tokens if got else 0} tokens, expected {expect}")
                        del s, got
            file_bytes = sum(p.stat().st_size for p in paths)
            payload = sum(2 * len(t.layers) * t.rows * store.binding.layout.row_bytes for t in hit.tiles)
            formula = cfg.kv_bytes(hit.n_tokens, 2 if args.kv == "f16" else 4)
            disk_formula = _disk_formula(paths, hit, store.binding.layout)
            results[n] = {
                "mode": pl["mode"], "document_tokens": n, "suffix_tokens": q,
                "prompt_tokens": len(ids), "prime_tokens": len(pl["prime"]),
                "shared_with_prime_tokens": _shared(pl["prime"], ids),
                "stored_prefix_tokens": hit.n_tokens, "suffix_prefill_tokens": len(ids) - hit.n_tokens,
                "entries": len(paths),
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
                    "read_verify_bytes_per_s": [file_bytes / x for x in t["read_verify_s"]],
                    "read_then_install_bytes_per_s": [file_bytes / x for x in t["read_then_install_s"]]}
        cells = run_interleaved(fns, reps=args.reps, warmup=args.warmup)
        gates = {}
        for n in lengths:  # the gate reads the latest timed cold and warm runs: no extra prefill
            (sc, lc), (sw, lw) = last.pop(f"cold/{n}"), last.pop(f"warm/{n}")
            restored = sw.last["restored"]
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
            gates[n] = {"restored": restored, "expected_restored": plans[n]["restore"],
                        "restored_as_expected": restored == plans[n]["restore"],
                        "suffix_tokens": len(plans[n]["timed"]) - restored, "prefill_chunk": sw.chunk,
                        # cold chunks start at 0, warm ones here: the same boundaries when it is a multiple
                        "suffix_start_on_chunk_boundary": restored % sw.chunk == 0,
                        "bitwise_first_logits": bitwise, "max_abs_delta_first_logits": delta,
                        "greedy_ids_identical": tc == tw, "text_identical": text_c == text_w, "text": text_c}
            del sc, sw
        disk = _read_bandwidth(d, max(16 << 20, 4 * max(r["bytes_on_disk"] for r in results.values())))
        one = args.reps == 1
        for n in lengths:
            c, w = cells[f"cold/{n}"], cells[f"warm/{n}"]
            rs = restore_s[f"warm/{n}"][len(w.warmup):]  # the counted runs' restores
            results[n].update({"ttft_cold_mean_s": c.mean, "ttft_cold_cv": None if one else c.cv,
                               "ttft_warm_mean_s": w.mean, "ttft_warm_cv": None if one else w.cv,
                               "speedup": c.mean / w.mean,
                               # what of the warm TTFT the restore took (Store.restore, host clock)
                               "warm_restore_s": rs, "warm_restore_share": float(np.mean(rs)) / w.mean})
            for mode in ("cold", "warm"):
                r = results[n][f"restore_{mode}"]
                r["restore_vs_disk_read"] = float(np.mean(r["restore_bytes_per_s"])) / disk["mean_bytes_per_s"]
                r["read_verify_vs_disk_read"] = float(np.mean(r["read_verify_bytes_per_s"])) / disk["mean_bytes_per_s"]
        ok = all(g["bitwise_first_logits"] and g["greedy_ids_identical"] and g["text_identical"]
                 and g["restored_as_expected"] and g["suffix_start_on_chunk_boundary"] for g in gates.values()) and \
            all(r["payload_equals_formula"] and r["disk_equals_formula"] for r in results.values())
        mode_name = plans[lengths[0]]["mode"]
        gate = {"status": "pass" if ok else "fail", "mode": mode_name,
                "rule": "warm first-token logits bitwise equal to cold; identical greedy text; the warm run "
                "restored exactly the expected tokens; stored KV payload equals MuseConfig.kv_bytes; entry "
                "files' bytes equal the byte format's formula", "per_length": gates,
                "bytes": {n: {"payload_equals_formula": r["payload_equals_formula"],
                              "disk_equals_formula": r["disk_equals_formula"]} for n, r in results.items()}}
        protocol = {"reps": args.reps, "warmup": args.warmup, "single_repetition": one,
                    "cv_rule": "null when --reps is 1 (one sample: no spread measured), else stdev / mean",
                    "restore_reps": RESTORE_REPS, "order": "interleaved cold/P warm/P per repetition"}
        path = write_receipt("kvpack", model=model_json(m), device=device_description(args.device), lane=args.lane,
                             gate=gate, cells=cells, out_dir=args.out_dir,
                             results={"kv": args.kv, "mode": {"name": mode_name, "suffix_tokens": q,
                                                              "rule": MODES[mode_name]},
                                      "protocol": protocol, "lengths": results, "disk_read": disk})
        for n in lengths:
            r = results[n]
            rc, rw = r["restore_cold"], r["restore_warm"]
            cv = "n=1, CV n/a" if one else f"CV {r['ttft_cold_cv']:.2f} / {r['ttft_warm_cv']:.2f}"
            print(f"{mode_name} P={n}{f' + Q={q}' if q else ''}: TTFT cold {r['ttft_cold_mean_s'] * 1e3:.1f} ms, "
                  f"warm {r['ttft_warm_mean_s'] * 1e3:.1f} ms ({r['speedup']:.2f}x, {cv}; "
                  f"{r['stored_prefix_tokens']} restored in {np.mean(r['warm_restore_s']) * 1e3:.1f} ms, "
                  f"{r['warm_restore_share']:.0%} of warm; {r['suffix_prefill_tokens']} prefilled); "
                  f"{r['bytes_on_disk_per_token']:.1f} B/token on disk (format formula: {r['disk_equals_formula']}), "
                  f"payload {r['formula_kv_bytes_per_token']:.0f} B/token == MuseConfig.kv_bytes: "
                  f"{r['payload_equals_formula']}; restore cold {np.mean(rc['restore_bytes_per_s']) / 1e9:.3f} GB/s "
                  f"(read + verify {np.mean(rc['read_verify_bytes_per_s']) / 1e9:.3f}), cached "
                  f"{np.mean(rw['restore_bytes_per_s']) / 1e9:.3f} GB/s (read + verify "
                  f"{np.mean(rw['read_verify_bytes_per_s']) / 1e9:.3f}, install after the reads "
                  f"{np.mean(rw['read_then_install_bytes_per_s']) / 1e9:.3f}) vs cold disk read "
                  f"{disk['mean_bytes_per_s'] / 1e9:.3f} GB/s")
        print(f"gate: {gate['status']}; receipt {path}")
        plot_for_run(args, path)
        return 0 if ok else 1
    finally:
        last.clear()
        m.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
