#!/usr/bin/env python3
"""Engine.step on CUDA, on the tiny synthetic fixture: several sequences' rows in one forward
against each sequence run alone (bitwise and max |d log-softmax|), row selection, all-or-nothing
rollback, Gate 2 (f32 and f16 K/V), and a side-by-side time of one 4-sequence step vs 4 decodes.

    python tools/device_step.py --out DIR [--budget SECONDS]

Writes DIR/step_cuda.json (rewritten after every part, so a run cut short keeps what it did).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SHAPES = [(1,), (1, 1), (1, 1, 1, 1), (2, 7), (3, 5, 1, 7), (4, 4, 4, 4), (16,), (16, 16, 16, 16)]
PROMPT = [6 + (i * 37) % 370 for i in range(120)]


def _tokens(i: int, T: int) -> list[int]:
    return [PROMPT[(7 * i + 3 * j + 5) % len(PROMPT)] for j in range(T)]


def _session(eng, i: int, graphs: bool):
    s = eng.session(max_context=128, graphs=graphs)
    s.prefill(PROMPT[i:i + 12 + 11 * i])
    return s


def step_vs_alone(eng) -> dict:
    from muser.engine import StepItem
    from muser.gates import max_dlsm

    out: dict = {}
    for shape in SHAPES:
        cell = {}
        for graphs in (False, True):  # alone: eager, or through the session's captured graphs
            batch = [_session(eng, i, graphs) for i in range(len(shape))]
            alone = [_session(eng, i, graphs) for i in range(len(shape))]
            toks = [_tokens(i, T) for i, T in enumerate(shape)]
            res = eng.step([StepItem(s, t, logits="all") for s, t in zip(batch, toks)])
            want = [a.verify(t) for a, t in zip(alone, toks)]
            nxt = eng.step([StepItem(s, [5]) for s in batch])
            want2 = [a.decode(5)[None] for a in alone]
            cell["graphs" if graphs else "eager"] = {
                "bitwise": all(np.array_equal(r.logits, w) for r, w in zip(res, want)),
                "max_dlsm": max(max_dlsm(r.logits, w) for r, w in zip(res, want)),
                "next_bitwise": all(np.array_equal(r.logits, w) for r, w in zip(nxt, want2)),
                "next_max_dlsm": max(max_dlsm(r.logits, w) for r, w in zip(nxt, want2)),
            }
        out["x".join(map(str, shape))] = cell
    return out


def selection_and_rollback(eng) -> dict:
    import muser.engine.forward as fw
    from muser.engine import StepItem
    from muser.errors import NonFiniteLogits
    from muser.gates import max_dlsm

    ss = [_session(eng, i, False) for i in range(3)]
    ref = [_session(eng, i, False) for i in range(3)]
    toks = [_tokens(0, 5), _tokens(1, 3), _tokens(2, 4)]
    res = eng.step([StepItem(ss[0], toks[0], logits=[0, 2, 4]), StepItem(ss[1], toks[1], logits="none"),
                    StepItem(ss[2], toks[2], logits="last")])
    full = [r.verify(t) for r, t in zip(ref, toks)]
    sel = {"rows_shape": list(res[0].logits.shape), "none_is_none": res[1].logits is None,
           "rows_max_dlsm": max_dlsm(res[0].logits, full[0][[0, 2, 4]]),
           "last_max_dlsm": max_dlsm(res[2].logits, full[2][-1:])}
    ss = [_session(eng, i, False) for i in range(3)]  # fresh: compared with fresh ones below
    before = [s.n_past for s in ss]
    orig = fw.softcap_logits

    def poison(lg, a, b):
        o = orig(lg, a, b)
        o[4, 11] = float("inf")
        return o

    fw.softcap_logits = poison
    try:
        eng.step([StepItem(s, _tokens(i, 3), logits="all") for i, s in enumerate(ss)])
        sel["non_finite"] = "not raised"
    except NonFiniteLogits as e:
        sel["non_finite"] = str(e)
    finally:
        fw.softcap_logits = orig
    sel["rolled_back"] = [s.n_past for s in ss] == before
    a = eng.step([StepItem(s, _tokens(i, 3), logits="all") for i, s in enumerate(ss)])
    b = eng.step([StepItem(_session(eng, i, False), _tokens(i, 3), logits="all") for i in range(3)])
    sel["after_rollback_bitwise"] = all(np.array_equal(x.logits, y.logits) for x, y in zip(a, b))
    return sel


def timing(eng, reps: int = 50) -> dict:
    """One step of 4 sequences x 1 row (batched graph; eager) vs 4 graph decodes, interleaved,
    each from the same positions; and the batched graph's logits against the eager step's."""
    from muser.engine import StepItem

    gs = [_session(eng, i, True) for i in range(4)]
    es = [_session(eng, i, False) for i in range(4)]
    for s in gs:  # warm the graphs and the eager kernels
        s.decode(5)
    for s in es:
        s.decode(5)
    eng.step([StepItem(s, [6]) for s in gs])
    eng.step([StepItem(s, [6]) for s in es])
    a = eng.step([StepItem(s, [8]) for s in gs])
    b = eng.step([StepItem(s, [8]) for s in es])
    out: dict = {"graph_vs_eager_bitwise": all(np.array_equal(x.logits, y.logits) for x, y in zip(a, b))}
    torch.cuda.synchronize()
    samples: dict = {"step4x1_graph_s": [], "step4x1_eager_s": [], "decode4_graphs_s": []}
    for _ in range(reps):
        for name, ss, fn in (("step4x1_graph_s", gs, lambda ss: eng.step([StepItem(s, [7]) for s in ss])),
                             ("step4x1_eager_s", es, lambda ss: eng.step([StepItem(s, [7]) for s in ss])),
                             ("decode4_graphs_s", gs, lambda ss: [s.decode(7) for s in ss])):
            cps = [s.checkpoint(block=1) for s in ss]
            t = time.perf_counter()
            fn(ss)
            samples[name].append(time.perf_counter() - t)
            for s, cp in zip(ss, cps):
                s.rollback(cp)
    out.update({k: {"median": float(np.median(v)), "mean": float(np.mean(v)), "n": len(v)}
                for k, v in samples.items()})
    out["graph_shapes"] = {repr(k[0]): g.captures for k, g in eng._graphs.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=240.0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if res["cuda"]:
        res["gpu"] = torch.cuda.get_device_name(0)

    def save():
        res["elapsed_s"] = time.time() - t0
        (a.out / "step_cuda.json").write_text(json.dumps(res, indent=1))

    import muser.oracle as oracle
    from muser.engine import Engine
    from muser.gates import gate2
    from muser.model.synth import SynthSpec, write_fixture

    path = Path("/tmp/muser-step-tiny.gguf")
    write_fixture(path, SynthSpec())
    parts = [
        ("step_vs_alone_f32", lambda e: step_vs_alone(e["f32"])),
        ("step_vs_alone_f16", lambda e: step_vs_alone(e["f16"])),
        ("selection_rollback", lambda e: selection_and_rollback(e["f32"])),
        ("timing_f16", lambda e: timing(e["f16"])),
        ("gate2_f32", lambda e: gate2(path, e["f32"], oracle.load(path, arithmetic="f32", kv="f32"), "f32",
                                      n_gen=64)),
        ("gate2_f16", lambda e: gate2(path, e["f16"], oracle.load(path, arithmetic="f32", kv="f16"), "f16",
                                      n_gen=64)),
    ]
    engines = {kv: Engine.open(path, device="cuda", lane="exact", kv=kv) for kv in ("f32", "f16")}
    for name, fn in parts:
        if time.time() - t0 > a.budget:
            res[name] = "skipped: budget"
            continue
        t = time.time()
        try:
            res[name] = fn(engines)
        except Exception:  # noqa: BLE001 - record and go on to the next part
            res[name] = {"error": traceback.format_exc()}
        res.setdefault("part_s", {})[name] = time.time() - t
        save()
        print(name, json.dumps(res[name])[:600], flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
