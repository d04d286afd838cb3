#!/usr/bin/env python3
"""Train the micro Muse Glimmer (torch; one GPU, time-boxed): one run, or the library the device
pipeline (tools/device_train.py) drives.

    python3 tools/train_micro.py --data STREAMS --out OUT [--budget-s 300] [--hidden 384 --ffn 1152]
    python3 tools/train_micro.py --data STREAMS --out /tmp/smoke --smoke      # CPU, tiny, seconds

Self-contained (torch + numpy only: the GPU machine has no gguf and no muser install). STREAMS holds
the uint16 token streams and their corpus.json (`tools/corpus.py build` for the stdlib alone,
`tools/corpus_carry.py tokenize` for a carried corpus). A run trains until its wall-clock budget is spent (AdamW,
linear warm-up then cosine to min_lr_ratio, bf16 autocast on the GPU), keeps the checkpoint with the
best val loss, measures val and held-out loss on it, and writes into OUT:
    micro-weights-N.npz   2-D tensors F16 (the GGUF master's values), 1-D tensors F32, under their
                          GGUF names, numpy order [out, in], <= 15 MiB each
    micro-run.json        geometry, weight manifest (tensor -> shard, shard SHA-256), the loss curve,
                          losses, provenance (rewritten after every evaluation)
so tools/export_micro.py turns them into GGUF by a straight copy. The model is tools/micro_net.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time
import traceback
from contextlib import ExitStack
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from micro_net import SMOKE, Geometry, MicroGlimmer, load_gguf_state  # noqa: E402

SHARD_LIMIT = 15 << 20  # bytes per weight shard (the device returns files <= 16 MiB)
RUN_FORMAT = "muse-glimmer-micro/2"
GEOMETRY_FIELDS = ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn", "window", "seq_len")
STOP: dict = {"why": None}  # set by SIGTERM / SIGINT; every loop checks it and winds down saving


def on_signal(signum, frame) -> None:
    STOP["why"] = f"signal {signum}"


@dataclass
class RunConfig:
    batch: int = 64  # sequences of seq_len per optimizer step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 150
    weight_decay: float = 0.1
    eval_every_s: float = 20.0
    max_steps: int = 0  # 0: time only
    max_epochs: float = 60.0
    seed: int = 1234
    amp: str = "bf16"  # autocast dtype on the GPU: bf16 | none


# ---------------------------------------------------------------------------------------------
# data


def load_stream(data_dir: str, split: str, manifest: dict, device) -> torch.Tensor:
    info = manifest["streams"][split]
    path = os.path.join(data_dir, info["file"])
    raw = open(path, "rb").read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != info["sha256"]:
        raise SystemExit(f"{path}: sha256 {digest} != corpus.json {info['sha256']}")
    a = np.frombuffer(raw, dtype="<u2")
    if a.size != info["tokens"]:
        raise SystemExit(f"{path}: {a.size} tokens, corpus.json says {info['tokens']}")
    return torch.from_numpy(a.astype(np.int32)).to(device)


def eval_windows(stream: torch.Tensor, L: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of L tokens (stride L, partial tail dropped): [n, L]; with a limit,
    `limit` of them evenly spaced over the stream (every package of a split is sampled)."""
    n = stream.numel() // L
    w = stream[: n * L].view(n, L).long()
    if limit is not None and limit < n:
        w = w[torch.linspace(0, n - 1, limit).round().long().to(w.device)]
    return w


class Streams:
    """The three token streams on the device, their eval windows, and where they came from."""

    def __init__(self, data_dir: str, vocab: int, seq_len: int, device, select_windows: int | None):
        self.manifest = json.load(open(os.path.join(data_dir, "corpus.json")))
        if int(self.manifest["tokenizer"]["vocab_size"]) != vocab:
            raise SystemExit(f"corpus.json vocab_size {self.manifest['tokenizer']['vocab_size']} != {vocab}")
        self.train = load_stream(data_dir, "train", self.manifest, device)
        self.val = load_stream(data_dir, "val", self.manifest, device)
        self.heldout = load_stream(data_dir, "heldout", self.manifest, device)
        for name, s in (("train", self.train), ("val", self.val), ("heldout", self.heldout)):
            if int(s.max()) >= vocab:
                raise SystemExit(f"{name} stream holds token {int(s.max())} >= vocab {vocab}")
        self.L = seq_len
        self.val_select = eval_windows(self.val, seq_len, select_windows)  # checkpoint selection
        self.val_full = eval_windows(self.val, seq_len)
        self.heldout_full = eval_windows(self.heldout, seq_len)

    def provenance(self) -> dict:
        m = self.manifest
        return {"streams": {k: {"file": v["file"], "tokens": v["tokens"], "sha256": v["sha256"]}
                            for k, v in m["streams"].items()},
                "tokenizer": m["tokenizer"],
                "eval_windows": {"seq_len": self.L, "val_select": int(self.val_select.shape[0]),
                                 "val": int(self.val_full.shape[0]), "heldout": int(self.heldout_full.shape[0])}}


def autocast(dev: str, amp: str):
    st = ExitStack()
    if dev.startswith("cuda"):  # flash (causal) / memory-efficient (window mask) kernels; cuDNN left out
        from torch.nn.attention import SDPBackend, sdpa_kernel

        st.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
    st.enter_context(torch.autocast("cuda" if dev.startswith("cuda") else "cpu", dtype=torch.bfloat16,
                                    enabled=amp == "bf16"))
    return st


@torch.no_grad()
def mean_nll(model: MicroGlimmer, windows: torch.Tensor, batch: int, dev: str, amp: str) -> float:
    """Mean NLL (nats) of tokens 1..L-1 of each window, each window a fresh context from position 0."""
    was = model.training
    model.eval()
    tot, cnt = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        with autocast(dev, amp):
            logits = model(w)[:, :-1]  # the whole window (T = L, the training shape); last row unused
        tot += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"))
        cnt += w[:, 1:].numel()
    model.train(was)
    return tot / max(cnt, 1)


@torch.no_grad()
def doc_nll(model: MicroGlimmer, seqs: list[list[int]], L: int, dev: str, batch: int = 64) -> tuple[float, int]:
    """(total NLL nats, scored tokens) of token sequences, every token after the first scored once:
    chunks seq[j(L-1) : j(L-1) + L], each a fresh context, scoring its tokens 1.. (the first chunk
    opens with BOS, the next ones with the previous chunk's last token). f32, TF32 off."""
    chunks = [s[j: j + L] for s in seqs for j in range(0, max(len(s) - 1, 1), L - 1) if len(s[j: j + L]) > 1]
    was, tf32 = model.training, torch.backends.cuda.matmul.allow_tf32
    model.eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    tot, cnt = 0.0, 0
    try:
        for i in range(0, len(chunks), batch):
            part = chunks[i: i + batch]
            n = max(len(c) for c in part)
            ids = torch.zeros((len(part), n), dtype=torch.long)
            lab = torch.full((len(part), n - 1), -100, dtype=torch.long)  # -100: not scored (padding)
            for r, c in enumerate(part):
                ids[r, : len(c)] = torch.tensor(c)
                lab[r, : len(c) - 1] = torch.tensor(c[1:])
            ids, lab = ids.to(dev), lab.to(dev)
            logits = model(ids)[:, :-1].float()  # padding sits after every scored row: causal, no effect
            tot += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="sum",
                                         ignore_index=-100))
            cnt += int((lab != -100).sum())
    finally:
        model.train(was)
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return tot, cnt


def bits_per_byte(model: MicroGlimmer, docs: list[tuple[str, bytes]], tok, bos: int, eos: int, L: int,
                  dev: str) -> dict:
    """Per-file scoring in f32 (comparable across tokenizers): [BOS] ids [EOS] per file (`tok` a
    `tokenizers.Tokenizer`), every token after BOS scored once (doc_nll), bits = NLL / ln 2 over the
    files' UTF-8 bytes."""
    seqs = [[bos] + tok.encode(d.decode("utf-8"), add_special_tokens=False).ids + [eos] for _, d in docs]
    nll, n_tok = doc_nll(model, seqs, L, dev)
    n_bytes = sum(len(d) for _, d in docs)
    return {"files": len(docs), "bytes": n_bytes, "scored_tokens": n_tok, "nll_nats": nll,
            "bits_per_byte": nll / math.log(2) / n_bytes, "nats_per_token": nll / n_tok,
            "files_sha256": hashlib.sha256("".join(f"{r}\n{hashlib.sha256(d).hexdigest()}\n" for r, d in docs)
                                           .encode()).hexdigest(),
            "framing": "per file [BOS] ids [EOS]; chunks of L tokens, each after the first opening with the "
                       "previous chunk's last token as unscored context; every token after BOS scored once; "
                       "f32 (TF32 off)"}


# ---------------------------------------------------------------------------------------------
# saving


def atomic_write(path: str, data: bytes) -> None:
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_json(path: str, body: dict) -> None:
    atomic_write(path, json.dumps(body, indent=1).encode())


def save_weights(out: str, state: dict[str, torch.Tensor], prefix: str = "micro-weights") -> dict:
    """Shards <out>/<prefix>-N.npz: 2-D tensors rounded to F16 here (numpy's round-to-nearest-even,
    ggml_fp32_to_fp16's rounding: the GGUF master's values), 1-D tensors F32. Returns the manifest."""
    arrays: dict[str, np.ndarray] = {}
    for name, t in state.items():
        a = t.detach().float().cpu().numpy()
        if a.ndim == 2:
            h = a.astype("<f2")
            if not np.all(np.isfinite(h)):
                raise SystemExit(f"tensor {name!r} overflows F16 (max |w| = {float(np.abs(a).max())})")
            arrays[name] = h
        else:
            arrays[name] = a.astype("<f4")
    shards: list[list[str]] = []  # first-fit decreasing into shards of <= SHARD_LIMIT bytes
    sizes: list[int] = []
    for name in sorted(arrays, key=lambda n: (-arrays[n].nbytes, n)):
        nb = arrays[name].nbytes
        for i, sz in enumerate(sizes):
            if sz + nb <= SHARD_LIMIT:
                shards[i].append(name)
                sizes[i] += nb
                break
        else:
            shards.append([name])
            sizes.append(nb)
    index, digests = {}, {}
    for i, names in enumerate(shards):
        fn = f"{prefix}-{i}.npz"
        path = os.path.join(out, fn)
        tmp = os.path.join(out, f".{fn}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **{n: arrays[n] for n in names})
        os.replace(tmp, path)
        digests[fn] = hashlib.sha256(open(path, "rb").read()).hexdigest()
        for n in names:
            index[n] = {"shard": fn, "shape": list(arrays[n].shape), "dtype": str(arrays[n].dtype)}
    keep = set(digests)
    for stale in sorted(os.listdir(out)):  # a previous save with more shards
        if stale.startswith(prefix + "-") and stale.endswith(".npz") and stale not in keep:
            os.unlink(os.path.join(out, stale))
    return {"tensors": index, "shards": digests}


def f16_rounded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state as the F16 master holds it: 2-D tensors through F16, 1-D kept F32."""
    return {k: (torch.from_numpy(v.float().numpy().astype("<f2").astype(np.float32)) if v.ndim == 2 else v)
            for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# training


def lr_at(step: int, progress: float, c: RunConfig) -> float:
    warm = min(1.0, (step + 1) / c.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return c.lr * warm * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cos)


def train(g: Geometry, c: RunConfig, data: Streams, budget_s: float, dev: str, label: str,
          on_eval=None, eval_batch: int = 64) -> dict:
    """One run of `budget_s` wall seconds (from its first step's start). Returns the record (loss
    curve, steps, tokens, FLOPs, best step) with the best-val state under "state" (f32, CPU) and the
    model (holding the last state) under "model". Errors are recorded, never raised: what was
    learned is kept."""
    g.check()
    t0 = time.time()
    torch.manual_seed(c.seed)
    model = MicroGlimmer(g)
    model.reset(c.seed)
    model.to(dev)
    on_cuda = dev.startswith("cuda")
    amp = c.amp if on_cuda else "none"
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norm weights: no decay toward 0
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=c.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if on_cuda else {}))
    gen = torch.Generator(device=dev).manual_seed(c.seed)  # same seed: every run sees the same windows
    L = g.seq_len
    ar = torch.arange(L + 1, device=dev)
    train_tokens = data.train.numel()
    fpt = g.train_flops_per_token()
    rec: dict = {"label": label, "geometry": asdict(g), "n_params": g.n_params(), "flops_per_token": fpt,
                 "config": asdict(c), "budget_s": budget_s, "curve": []}
    best = {"val": float("inf"), "state": None, "step": -1}
    step, tokens, micro, accum = 0, 0, c.batch, 1
    run_loss, run_n = torch.zeros((), device=dev), 0
    t_train = time.time()
    last_eval = t_train
    max_tokens = c.max_epochs * train_tokens

    def evaluate() -> float:
        v = mean_nll(model, data.val_select, eval_batch, dev, amp)
        if v < best["val"]:  # NaN never wins
            best.update(val=v, step=step, state=model.gguf_state())
        return v

    try:
        while not STOP["why"]:
            progress = max((time.time() - t_train) / budget_s, tokens / max_tokens,
                           step / c.max_steps if c.max_steps else 0.0)
            if progress >= 1.0:
                break
            lr = lr_at(step, progress, c)
            for grp in opt.param_groups:
                grp["lr"] = lr
            try:
                for _ in range(accum):
                    off = torch.randint(0, train_tokens - L - 1, (micro,), device=dev, generator=gen)
                    chunk = data.train[off[:, None] + ar[None, :]].long()  # [micro, L + 1]
                    with autocast(dev, amp):
                        logits = model(chunk[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, g.vocab), chunk[:, 1:].reshape(-1))
                    (loss / accum).backward()
                    run_loss += loss.detach()
                    run_n += 1
            except torch.cuda.OutOfMemoryError:
                if step > 0 or micro == 1:
                    raise
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                micro, accum = micro // 2, accum * 2
                run_loss.zero_()
                run_n = 0
                print(f"{label}: out of memory at the first step; micro-batch {micro} x {accum}", flush=True)
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += c.batch * L
            if step == 1:
                rec["first_step_s"] = round(time.time() - t0, 2)
            now = time.time()
            due = now - last_eval >= c.eval_every_s
            if due or step % 50 == 0:
                tl = float(run_loss) / max(run_n, 1)
                run_loss.zero_()
                run_n = 0
                if not math.isfinite(tl):
                    STOP["why"] = STOP["why"] or f"non-finite train loss {tl} at step {step} ({label})"
                    break
                pt = {"step": step, "tokens": tokens, "flops": tokens * fpt, "epochs": round(tokens / train_tokens, 4),
                      "t_s": round(now - t_train, 2), "lr": lr, "train_loss": round(tl, 5)}
                if due:
                    pt["val_loss"] = round(evaluate(), 5)
                    last_eval = time.time()
                    pt["tok_per_s"] = round(tokens / (last_eval - t_train))
                    print(f"{label} step {step:6d} ep {pt['epochs']:6.3f} lr {lr:.2e} train {tl:.4f} "
                          f"val {pt['val_loss']:.4f} {pt['tok_per_s']:,} tok/s t={pt['t_s']}s", flush=True)
                rec["curve"].append(pt)
                if due and on_eval is not None:
                    on_eval(rec)
    except Exception as e:  # keep what was learned; the device run is not repeatable cheaply
        rec["error"] = "".join(traceback.format_exception(e))[-4000:]
        print(rec["error"], flush=True)
    rec.update(steps=step, tokens=tokens, flops=tokens * fpt, epochs=round(tokens / train_tokens, 4),
               train_s=round(time.time() - t_train, 2), stop=STOP["why"] or "budget", micro_batch=micro, accum=accum)
    if step > 0 and "error" not in rec:
        try:  # the last state is a candidate too
            rec["final"] = {"step": step, "val_select_loss": round(evaluate(), 5)}
        except Exception as e:
            rec["error"] = "".join(traceback.format_exception(e))[-4000:]
    if best["state"] is not None:
        rec["best"] = {"step": best["step"], "val_select_loss": best["val"]}
    elif "error" not in rec:
        rec["error"] = f"no checkpoint with a finite val loss (stop: {rec['stop']})"
    if on_cuda:
        rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    rec["state"], rec["model"] = best["state"], model
    return rec


def public(rec: dict) -> dict:
    """The JSON part of a run record (no state, no model)."""
    return {k: v for k, v in rec.items() if k not in ("state", "model")}


def measure_best(rec: dict, data: Streams, dev: str, eval_batch: int = 64) -> dict:
    """Load the best state, rounded as the F16 master holds it, into the run's model; full val and
    held-out loss of that master. Returns the f16-rounded state (what ships)."""
    model = rec["model"]
    master = f16_rounded(rec["state"])
    load_gguf_state(model, {k: v.to(next(model.parameters()).device) for k, v in master.items()})
    amp = rec["config"]["amp"] if dev.startswith("cuda") else "none"
    rec["best"]["val_loss"] = mean_nll(model, data.val_full, eval_batch, dev, amp)
    rec["best"]["heldout_loss"] = mean_nll(model, data.heldout_full, eval_batch, dev, amp)
    rec["best"]["weights"] = "F16 master (2-D tensors rounded to F16), measured with " + amp + " autocast"
    return master


def run_body(rec: dict, data: Streams, weights: dict | None, extra: dict | None = None) -> dict:
    body = {"format": RUN_FORMAT, "geometry": rec["geometry"], "n_params": rec["n_params"],
            "selected": {"step": rec.get("best", {}).get("step"), "rule": "best val_select loss",
                         "val_select_loss": rec.get("best", {}).get("val_select_loss")},
            "corpus": data.provenance(), "torch": torch.__version__, "main": public(rec)}
    if weights is not None:
        body["weights"] = weights
    body.update(extra or {})
    return body


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with corpus.json and the .u16 streams")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny geometry on the CPU, 12 steps")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (default with --smoke)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall seconds of training")
    for f in ("batch", "warmup_steps", "max_steps", "seed"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(RunConfig, f))
    for f in ("lr", "min_lr_ratio", "weight_decay", "eval_every_s", "max_epochs"):
        ap.add_argument("--" + f.replace("_", "-"), type=float, default=getattr(RunConfig, f))
    ap.add_argument("--amp", choices=["bf16", "none"], default="bf16")
    ap.add_argument("--select-windows", type=int, default=128, help="val windows used to pick the checkpoint")
    for f in GEOMETRY_FIELDS:
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=None)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    dev = a.device or ("cpu" if a.smoke else "cuda")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("CUDA requested but torch.cuda.is_available() is False")
    signal.signal(signal.SIGTERM, on_signal)
    geo = dict(SMOKE) if a.smoke else {}
    geo.update({f: getattr(a, f) for f in GEOMETRY_FIELDS if getattr(a, f) is not None})
    manifest = json.load(open(os.path.join(a.data, "corpus.json")))
    g = Geometry(vocab=int(manifest["tokenizer"]["vocab_size"]), **geo)
    g.check()
    c = RunConfig(**{f: getattr(a, f) for f in RunConfig.__dataclass_fields__})
    if a.smoke:
        c.batch, c.max_steps, c.warmup_steps, c.eval_every_s = min(c.batch, 8), c.max_steps or 12, 4, 0.0
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data = Streams(a.data, g.vocab, g.seq_len, dev, 8 if a.smoke else a.select_windows)
    if a.smoke:
        data.val_full, data.heldout_full = data.val_full[:8], data.heldout_full[:8]
    print(f"micro: {g.n_params():,} params, geometry {asdict(g)}; train {data.train.numel():,} tokens", flush=True)
    out_json = os.path.join(a.out, "micro-run.json")
    rec = train(g, c, data, 1e9 if a.smoke else a.budget_s, dev, "micro",
                on_eval=lambda r: write_json(out_json, run_body(r, data, None)), eval_batch=8 if a.smoke else 64)
    weights = None
    if rec["state"] is not None:
        try:
            master = measure_best(rec, data, dev, 8 if a.smoke else 64)
            weights = save_weights(a.out, master)
        except Exception as e:
            rec["error"] = "".join(traceback.format_exception(e))[-4000:]
    status = "error" if "error" in rec else "done"
    write_json(out_json, run_body(rec, data, weights, {"status": status, "wall_s": round(time.time() - t_start, 1)}))
    b = rec.get("best", {})
    print(f"micro: {status} after {rec['steps']} steps, {rec['tokens']:,} tokens ({rec['epochs']} epochs); "
          f"best step {b.get('step')} val {b.get('val_loss')} heldout {b.get('heldout_loss')}", flush=True)
    return 0 if status == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
