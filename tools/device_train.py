#!/usr/bin/env python3
"""The micro model's whole training, in one GPU call (tools/device_train.sh runs it on the H200):

    python3 tools/device_train.py --carry .device/corpus --streams /tmp/streams --out $OUT [--deadline-s 560]
    python3 tools/device_train.py --carry CARRY --streams DIR --out DIR --smoke     # CPU, tiny, a minute

Stages, each inside one wall-clock deadline (a stage that runs long shortens the ones after it):
  1. tokenize the carried corpus (tools/corpus_carry.py tokenize_carry: xz shards -> uint16 streams);
  2. a scaling sweep: each SWEEP geometry trained for --sweep-s seconds on the same windows in the same
     order, val loss against tokens and FLOPs recorded;
  3. the size for the main run chosen from the sweep (choose_size's rule), trained for what the
     deadline leaves after the drafter's share; the best-val checkpoint, rounded to the F16 master,
     measured on the full val and held-out streams and, per file, on the stdlib held-out files (bits
     per byte, f32, for comparison across tokenizers);
  4. the DFlash drafter distilled on that master (tools/train_drafter.py distill; a drafter alone, for a
     shipped target GGUF, is `tools/device_train.sh drafter`).
Outputs in OUT (8 files at most, each <= 16 MiB): micro-weights-N.npz (F16 master), drafter-weights.npz,
micro-run.json (geometry, sweep curve, losses, the drafter's record, provenance; rewritten after each
stage, so a run cut short still returns what it finished). SIGTERM winds the current stage down and
saves.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_drafter as td  # noqa: E402
import train_micro as tm  # noqa: E402
from micro_net import SMOKE, Geometry  # noqa: E402

# The sweep: width scaled at fixed depth (8 layers = the collar twice), 8 query / 2 KV heads of 64
# (attention width 512 != hidden, a kept trap), FFN 3 x hidden. 12.6M / 17.2M / 22.4M parameters.
SWEEP = ({"hidden": 256, "ffn": 768}, {"hidden": 320, "ffn": 960}, {"hidden": 384, "ffn": 1152})
SMOKE_SWEEP = ({"hidden": 32, "ffn": 64}, {"hidden": 48, "ffn": 96}, {"hidden": 64, "ffn": 128})
MAX_PARAMS = 25_000_000  # the shipped Q8_0 + drafter stay well under models/'s 45 MB
CHINCHILLA_EXPONENT = 0.5  # compute-optimal parameters grow as C^0.5 (Hoffmann et al. 2022)


def choose_size(sweep: list[dict], main_s: float, sweep_s: float) -> dict:
    """The main run's geometry from the sweep. At the sweep's compute the best size N* is the vertex
    of a parabola through (log N, val loss) when the minimum is interior, else the winning end; at the
    main run's compute (time x the same GPU) the optimum moves to N* (main_s / sweep_s)^0.5; the
    candidate closest to that in log N, within MAX_PARAMS, is chosen."""
    ok = [r for r in sweep if "error" not in r and math.isfinite(r.get("best", {}).get("val_select_loss", math.nan))]
    if not ok:
        raise SystemExit("every sweep run failed: no size to choose")
    logn = np.log([r["n_params"] for r in ok])
    loss = np.array([r["best"]["val_select_loss"] for r in ok])
    i = int(np.argmin(loss))
    if 0 < i < len(ok) - 1:
        a, b, _ = np.polyfit(logn[i - 1: i + 2], loss[i - 1: i + 2], 2)
        log_star = float(-b / (2 * a)) if a > 0 else float(logn[i])
        how = "parabola vertex through the minimum and its neighbours"
    else:
        log_star = float(logn[i])
        how = "the winning end of the sweep (no extrapolation beyond it)"
    target = log_star + CHINCHILLA_EXPONENT * math.log(main_s / sweep_s)
    fits = [r for r in ok if r["n_params"] <= MAX_PARAMS]
    pick = min(fits, key=lambda r: abs(math.log(r["n_params"]) - target))
    return {"n_star_at_sweep": round(math.exp(log_star)), "how": how, "main_s": main_s, "sweep_s": sweep_s,
            "n_target_at_main": round(math.exp(target)), "chosen": pick["label"], "n_params": pick["n_params"],
            "geometry": pick["geometry"],
            "rule": f"N_main = N* x (main_s / sweep_s)^{CHINCHILLA_EXPONENT}, nearest sweep size in log N, "
                    f"<= {MAX_PARAMS:,} parameters"}


def stdlib_docs(carry: str, listing: str, corpus_carry) -> list[tuple[str, bytes]]:
    """The stdlib held-out files out of the carried held-out shards, in the listing's order: a carried
    document is one of them when its content has the listed SHA-256 and its relpath is the listed one
    (or ends with "/" + it: the carry may name the stdlib by a folder). A missing file is refused."""
    import hashlib
    import json
    from pathlib import Path

    want = json.loads(Path(listing).read_text())["files"]
    man = json.loads((Path(carry) / "corpus.json").read_text())
    by_sha: dict[str, list[tuple[str, bytes]]] = {}
    for info in man["carried"]["heldout"]["shards"]:
        for rel, data in corpus_carry.read_shard(Path(carry), info):
            by_sha.setdefault(hashlib.sha256(data).hexdigest(), []).append((rel, data))
    out = []
    for w in want:
        hit = [(r, d) for r, d in by_sha.get(w["sha256"], []) if r == w["relpath"] or r.endswith("/" + w["relpath"])]
        if not hit:
            raise SystemExit(f"stdlib held-out file {w['relpath']!r} (sha256 {w['sha256'][:12]}) is not in the carry")
        out.append((w["relpath"], hit[0][1]))
    return out


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carry", required=True, help="the carried corpus folder (tools/corpus_carry.py)")
    ap.add_argument("--streams", required=True, help="scratch folder for the tokenized streams")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stdlib-heldout", required=True,
                    help="JSON list of the stdlib held-out files (relpath, sha256): tools/export_micro.py --stdlib-list")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="wall seconds from start for everything")
    ap.add_argument("--sweep-s", type=float, default=35.0, help="training seconds per sweep size")
    ap.add_argument("--drafter-s", type=float, default=100.0, help="seconds kept for the drafter")
    ap.add_argument("--min-main-s", type=float, default=180.0, help="sweep sizes are dropped to keep this for the main run")
    ap.add_argument("--reserve-s", type=float, default=25.0, help="seconds kept for measuring and saving")
    ap.add_argument("--smoke", action="store_true", help="tiny geometries on the CPU, a few steps each")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, tm.on_signal)
    signal.signal(signal.SIGINT, tm.on_signal)
    os.makedirs(a.out, exist_ok=True)
    dev = "cpu" if a.smoke else "cuda"
    if dev == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("CUDA requested but torch.cuda.is_available() is False")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    left = lambda: a.deadline_s - (time.time() - t0)  # noqa: E731
    out_json = os.path.join(a.out, "micro-run.json")
    print(f"device_train: python {sys.version.split()[0]} torch {torch.__version__} numpy {np.__version__} "
          f"cuda {torch.cuda.is_available()} cores {os.cpu_count()}", flush=True)
    run: dict = {"format": tm.RUN_FORMAT, "status": "running", "device": dev, "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None, "args": vars(a), "stages": {}}

    def save() -> None:
        run["wall_s"] = round(time.time() - t0, 1)
        tm.write_json(out_json, run)

    def stage(name: str, t: float) -> None:
        run["stages"][name] = round(time.time() - t, 2)
        print(f"device_train: {name} done in {run['stages'][name]}s ({left():.0f}s left)", flush=True)
        save()

    # 1. tokenize the carry
    import corpus_carry
    from tokenizers import Tokenizer

    from muser.corpus import BOS, EOS, MASK

    t = time.time()
    corpus_carry.tokenize_carry(a.carry, a.streams, log=lambda m: print(m, flush=True))
    tok = Tokenizer.from_file(os.path.join(a.carry, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    bos, eos, mask_id = (tok.token_to_id(s) for s in (BOS, EOS, MASK))
    seq_len = SMOKE["seq_len"] if a.smoke else Geometry(vocab=vocab).seq_len
    data = tm.Streams(a.streams, vocab, seq_len, dev, 8 if a.smoke else 128)
    if a.smoke:
        data.val_full, data.heldout_full = data.val_full[:8], data.heldout_full[:8]
    run["corpus"] = dict(data.provenance(), carried={k: v for k, v in data.manifest.items() if k != "streams"})
    stage("tokenize", t)

    base = dict(SMOKE) if a.smoke else {}
    sizes = SMOKE_SWEEP if a.smoke else SWEEP
    eb = 8 if a.smoke else 64

    def cfg(**kw) -> tm.RunConfig:
        c = tm.RunConfig(**kw)
        if a.smoke:
            c.batch, c.max_steps, c.warmup_steps = 8, 6, 2
        return c

    # 2. the sweep
    t = time.time()
    run["sweep"] = []
    for i, geo in enumerate(sizes):
        if tm.STOP["why"] or left() < a.drafter_s + a.reserve_s + a.min_main_s + a.sweep_s + 5:
            run["sweep_cut"] = f"stopped before size {i}: {tm.STOP['why'] or 'deadline'}"
            break
        g = Geometry(vocab=vocab, **dict(base, **geo))
        rec = tm.train(g, cfg(warmup_steps=40, eval_every_s=0.0 if a.smoke else 5.0), data,
                       1e9 if a.smoke else a.sweep_s, dev, f"sweep-{g.hidden}", eval_batch=eb)
        run["sweep"].append(tm.public(rec))
        del rec
        if dev == "cuda":
            torch.cuda.empty_cache()
        save()
    stage("sweep", t)

    # 3. the main run
    t = time.time()
    main_s = max(10.0, left() - a.drafter_s - a.reserve_s)
    try:
        run["choice"] = choose_size(run["sweep"], main_s, a.sweep_s)
    except SystemExit as e:
        run["choice_error"] = str(e)
        run["choice"] = {"chosen": "largest (sweep gave no choice)",
                         "geometry": asdict(Geometry(vocab=vocab, **dict(base, **sizes[-1])))}
    g = Geometry(**run["choice"]["geometry"])

    def partial(r: dict) -> None:
        run["main"] = tm.public(r)
        save()

    rec = tm.train(g, cfg(warmup_steps=150, eval_every_s=0.0 if a.smoke else 20.0), data,
                   1e9 if a.smoke else main_s, dev, "main", on_eval=partial, eval_batch=eb)
    model = rec["model"]
    if rec["state"] is not None:
        try:
            master = tm.measure_best(rec, data, dev, eb)
            run["weights"] = tm.save_weights(a.out, master)
            run["geometry"], run["n_params"] = rec["geometry"], rec["n_params"]
            run["selected"] = {"step": rec["best"]["step"], "rule": "best val_select loss",
                               "val_select_loss": rec["best"]["val_select_loss"]}
        except Exception as e:
            rec["error"] = "".join(traceback.format_exception(e))[-4000:]
            print(rec["error"], flush=True)
    run["main"] = tm.public(rec)
    save()
    if "weights" in run:
        try:
            docs = stdlib_docs(a.carry, a.stdlib_heldout, corpus_carry)
            with torch.autocast("cuda" if dev == "cuda" else "cpu", enabled=False):
                run["stdlib_heldout"] = tm.bits_per_byte(model, docs, tok, bos, eos, g.seq_len, dev)
            print(f"device_train: stdlib held-out {run['stdlib_heldout']['bits_per_byte']:.4f} bits/byte", flush=True)
        except Exception as e:
            run["stdlib_heldout_error"] = "".join(traceback.format_exception(e))[-4000:]
            print(run["stdlib_heldout_error"], flush=True)
    stage("main", t)

    # 4. the drafter on the F16 master
    if "weights" in run and not tm.STOP["why"]:
        t = time.time()
        try:
            ids = lambda s: s.detach().cpu().long()  # noqa: E731
            _, drec = td.distill(model, g, ids(data.train), ids(data.heldout), mask_id,
                                 max(10.0, left() - 10.0), smoke=a.smoke, log=lambda m: print(m, flush=True),
                                 on_trained=lambda arrs: td.save_weights(a.out, arrs))
            run["drafter"] = drec
        except Exception as e:
            run["drafter_error"] = "".join(traceback.format_exception(e))[-4000:]
            print(run["drafter_error"], flush=True)
        stage("drafter", t)
    ok = "weights" in run and run.get("drafter", {}).get("status") == "done" and "error" not in run["main"]
    run["status"] = "done" if ok else "partial"
    run["stop"] = tm.STOP["why"]
    save()
    b = run["main"].get("best", {})
    print(f"device_train: {run['status']} in {run['wall_s']}s; main {run['main'].get('steps')} steps "
          f"{run['main'].get('tokens')} tokens; best step {b.get('step')} val {b.get('val_loss')} "
          f"heldout {b.get('heldout_loss')}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
