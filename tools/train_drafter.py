#!/usr/bin/env python3
"""Train the micro model's DFlash drafter by distillation (book ch. 8), in three steps:

    tools/train_drafter.py prepare --target models/muse-glimmer-micro-f16.gguf --out .device/spec/data
        here: the train split of the corpus (tools/corpus.py rule) tokenized with the target's own vocab
        into train.u16 / heldout.u16, and meta.json (target SHA-256, both geometries)
    python3 tools/train_drafter.py train --data .device/spec/data --target models/muse-glimmer-micro-f16.gguf \
        --out OUT [--budget-s 420]
        on the GPU machine (torch + numpy only; muser.spec.net from PYTHONPATH=.device/spec/src): writes
        drafter-weights.npz (f32, GGUF names, numpy order) and drafter-train-log.json into OUT
    tools/train_drafter.py export --weights OUT --data .device/spec/data --target models/...-f16.gguf \
        --out models/muse-glimmer-micro-dflash.gguf
        here: the sidecar GGUF (muser.spec.format.write_drafter, F16 weights) and its .pin.json

Distillation targets are the target model's own greedy outputs: (a) greedy continuations the target
generates from prompts cut out of the train split (where the text IS the target's greedy path), and
(b) train-split windows, each position labelled with the target's argmax there. The drafter sees the
target's layer-input residuals at its target layers for every context position (fp32 target forward,
the graph of src/models/muse-glimmer.cpp via tools/train_micro.py) and learns to fill the block
[x_n, <mask> x 15] at positions n..n+15 with the target's greedy tokens for positions n+1..n+15; the
context of a block is every position before n (the drafter's context ABI: sink 64 + window 2048 covers
the micro model's whole 1,024-token context). Loss: cross-entropy per block row, weighted 0.9^(row-1)
(acceptance is prefix-bound). Embedding and LM head are the target's (shared, frozen, not shipped).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

# drafter geometry (hidden = the target's)
DRAFT = {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "ffn": 768, "block_size": 16,
         "window": 2048, "target_layers": [1, 4, 7], "rope_base": 10000.0, "eps": 1e-6}
SEQ = 512  # training sequence length (prompt + greedy continuation, or a train window)
ANCHORS = 16  # blocks per sequence per step


# ---------------------------------------------------------------------------------------------
# prepare (here)

def prepare(target: Path, out: Path, root: Path | None) -> int:
    import corpus

    from muser.gguf.reader import read_gguf

    out.mkdir(parents=True, exist_ok=True)
    f = read_gguf(target)
    tok = corpus.tokenizer_from_vocab(list(f.get("tokenizer.ggml.tokens")), list(f.get("tokenizer.ggml.merges")))
    docs = corpus.load_docs(root or corpus.DEFAULT_ROOT)
    meta = {"target": str(target), "target_sha256": hashlib.sha256(target.read_bytes()).hexdigest(),
            "streams": {}}
    for split in ("train", "heldout"):
        sd = corpus.split_docs(docs, split)
        ids = corpus.encode_docs(tok, sd)
        (out / f"{split}.u16").write_bytes(ids.astype("<u2").tobytes())
        meta["streams"][split] = {"files": len(sd), "tokens": int(ids.size), "split_sha256": corpus.split_sha256(sd)}
        print(split, len(sd), "files", ids.size, "tokens", flush=True)
    g = {k: f.get(k) for k in f.fields if k.startswith("muse-glimmer.")}
    meta["target_geometry"] = {"hidden": g["muse-glimmer.embedding_length"], "n_layers": g["muse-glimmer.block_count"],
                               "vocab": len(f.get("tokenizer.ggml.tokens")),
                               "context_length": g["muse-glimmer.context_length"]}
    meta["mask_token"] = int(f.get("tokenizer.ggml.mask_token_id"))
    meta["bos"], meta["eos"] = int(f.get("tokenizer.ggml.bos_token_id")), int(f.get("tokenizer.ggml.eos_token_id"))
    meta["draft"] = DRAFT
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    f.close()
    return 0


# ---------------------------------------------------------------------------------------------
# train (GPU machine)

def train(data: Path, target_path: Path, out: Path, budget_s: float, smoke: bool) -> int:
    import torch
    import torch.nn.functional as F
    import train_micro as tm

    from muser.gguf.reader import read_gguf
    from muser.spec.net import NetGeometry, block_hidden, context_kv, fuse

    t_start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((data / "meta.json").read_text())
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # target features and labels in true fp32
    torch.backends.cudnn.allow_tf32 = False
    tg = meta["target_geometry"]
    geo = tm.Geometry(vocab=tg["vocab"], seq_len=tg["context_length"])
    target = tm.MicroGlimmer(geo).to(dev)
    tf = read_gguf(target_path)  # the F16 master: F16 / F32 tensors read as typed views
    if hashlib.sha256(Path(target_path).read_bytes()).hexdigest() != meta["target_sha256"]:
        raise SystemExit(f"{target_path} is not the target prepare read ({meta['target_sha256'][:12]}...)")
    tm.load_gguf_state(target, {t.name: torch.from_numpy(np.asarray(tf.array(t.name), dtype=np.float32)) for t in tf})
    tf.close()
    target.eval().requires_grad_(False)
    layers = list(DRAFT["target_layers"])
    H = geo.hidden

    def target_pass(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (features [B, T, n_cap*H] f32, greedy labels [B, T]: argmax at each position)."""
        x = tm.rms(F.embedding(ids, target.token_embd), geo.rms_eps)
        caps = []
        for il, b in enumerate(target.blocks):
            if il in layers:
                caps.append(x)
            x = b(x, target.cos, target.sin, target.mask)
        x = tm.rms(x, geo.rms_eps) * target.output_norm
        logits = F.linear(x, target.output)  # scale and softcap are monotone: argmax unchanged
        return torch.cat(caps, -1), logits.argmax(-1)

    train_ids = torch.from_numpy(np.frombuffer((data / "train.u16").read_bytes(), dtype="<u2").astype(np.int64))
    held_ids = torch.from_numpy(np.frombuffer((data / "heldout.u16").read_bytes(), dtype="<u2").astype(np.int64))
    seq = 64 if smoke else SEQ
    gen = torch.Generator().manual_seed(1234)

    # (a) greedy continuations from train-split prompts (full recompute; the target is tiny)
    n_gen_batches, gen_batch = (1, 4) if smoke else (int(os.environ.get("DRAFT_GEN_BATCHES", "3")), 256)
    gen_seqs = []
    t0 = time.time()
    with torch.no_grad():
        for gb in range(n_gen_batches):
            p = int(torch.randint(16, seq // 2, (1,), generator=gen))
            starts = torch.randint(0, train_ids.numel() - p, (gen_batch,), generator=gen)
            cur = torch.stack([train_ids[s:s + p] for s in starts.tolist()]).to(dev)
            while cur.shape[1] < seq:
                _, lab = target_pass(cur)
                cur = torch.cat((cur, lab[:, -1:]), 1)
            gen_seqs.append(cur.cpu())
            print(f"gen batch {gb}: prompt {p}, {time.time() - t0:.1f}s", flush=True)
            if time.time() - t0 > budget_s * 0.15:  # keep most of the budget for training
                break
    gen_seqs = torch.cat(gen_seqs)
    t_gen = time.time() - t0

    ng = NetGeometry(H, DRAFT["n_layers"], DRAFT["n_heads"], DRAFT["n_kv_heads"], DRAFT["head_dim"], DRAFT["ffn"],
                     len(layers), DRAFT["head_dim"], DRAFT["rope_base"], DRAFT["eps"],
                     1.0 / math.sqrt(DRAFT["head_dim"]), 0.0, 0.0)
    pgen = torch.Generator().manual_seed(7)

    def P(*shape, scale=None, ones=False):
        if ones:
            return torch.nn.Parameter(torch.ones(*shape, device=dev))
        w = torch.randn(*shape, generator=pgen) / math.sqrt(shape[1] if scale is None else scale)
        return torch.nn.Parameter(w.to(dev))

    hd, nh, nkv, ff = DRAFT["head_dim"], DRAFT["n_heads"], DRAFT["n_kv_heads"], DRAFT["ffn"]
    W = {"fc": P(H, len(layers) * H), "enc.output_norm": P(H, ones=True), "output_norm": P(H, ones=True),
         "layers": []}
    for _ in range(DRAFT["n_layers"]):
        W["layers"].append({"attn_norm": P(H, ones=True), "attn_q": P(nh * hd, H), "attn_k": P(nkv * hd, H),
                            "attn_v": P(nkv * hd, H), "attn_output": P(H, nh * hd, scale=nh * hd * 4),
                            "attn_q_norm": P(hd, ones=True), "attn_k_norm": P(hd, ones=True),
                            "ffn_norm": P(H, ones=True), "ffn_gate": P(ff, H), "ffn_up": P(ff, H),
                            "ffn_down": P(H, ff, scale=ff * 4)})
    params = [W["fc"], W["enc.output_norm"], W["output_norm"]] + [p for L in W["layers"] for p in L.values()]
    print(f"drafter params {sum(p.numel() for p in params):,}", flush=True)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    mask_tok = meta["mask_token"]
    B = 4 if smoke else 48
    A = 4 if smoke else ANCHORS
    K = DRAFT["block_size"]
    row_w = torch.tensor([0.0] + [0.9 ** (i - 1) for i in range(1, K)], device=dev)

    def batch(step_gen: torch.Generator, source: torch.Tensor | None):
        if source is None:  # a train-split window
            st = torch.randint(0, train_ids.numel() - seq, (B,), generator=step_gen)
            return torch.stack([train_ids[s:s + seq] for s in st.tolist()])
        idx = torch.randint(0, source.shape[0], (B,), generator=step_gen)
        return source[idx]

    def loss_of(ids: torch.Tensor, anchor_gen: torch.Generator, stats: bool = False):
        ids = ids.to(dev)
        with torch.no_grad():
            feats, lab = target_pass(ids)  # [B, T, 3H], [B, T]
        Bn, T = ids.shape
        anchors = torch.randint(1, T - K + 1, (Bn, A), generator=anchor_gen).to(dev)  # [B, A]
        offs = torch.arange(K, device=dev)
        qpos = (anchors[:, :, None] + offs).reshape(Bn, A * K)  # [B, A*K]
        toks = torch.full((Bn, A, K), mask_tok, dtype=torch.long, device=dev)
        toks[:, :, 0] = torch.gather(ids, 1, anchors)
        # row i of block a: the target's greedy token for position n+i = argmax at position n+i-1
        labels = torch.gather(lab, 1, (qpos - 1).clamp(min=0)).view(Bn, A, K)
        cpos = torch.arange(T, device=dev)
        ctx_vis = cpos[None, None, :] < anchors.view(Bn, A, 1)  # [B, A, T]
        ctx_vis = ctx_vis[:, :, None, :].expand(Bn, A, K, T).reshape(Bn, A * K, T)
        blk = torch.arange(A, device=dev).repeat_interleave(K)
        blk_vis = (blk[:, None] == blk[None, :])[None].expand(Bn, A * K, A * K)
        mask = torch.cat((ctx_vis, blk_vis), -1)  # [B, A*K, T + A*K]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            fz = fuse(W, feats, ng)
            ctx = [context_kv(W, il, fz, cpos[None].expand(Bn, T), ng) for il in range(ng.n_layers)]
            emb = F.embedding(toks.view(Bn, A * K), target.token_embd)
            hid = block_hidden(W, emb, qpos, ctx, ng, mask)
            logits = F.linear(hid, target.output).float().view(Bn, A, K, -1)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(Bn, A, K)
        loss = (ce * row_w).sum() / (row_w.sum() * Bn * A)
        if not stats:
            return loss, None
        hit = (logits.argmax(-1) == labels)[:, :, 1:]  # [B, A, K-1]
        acc_len = hit.int().cumprod(-1).sum(-1).float()  # accepted prefix per block (15 proposals)
        return loss, {"mean_accepted_15": float(acc_len.mean()), "top1_row1": float(hit[:, :, 0].float().mean())}

    log = {"status": "running", "draft": DRAFT, "seq": seq, "batch": B, "anchors": A, "gen_sequences": int(gen_seqs.shape[0]),
           "gen_s": t_gen, "curve": []}
    step_gen, eval_gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(5)
    held_windows = torch.stack([held_ids[s:s + seq] for s in
                                torch.randint(0, held_ids.numel() - seq, (8 if smoke else 64,), generator=eval_gen).tolist()])
    eval_gen_seqs = gen_seqs[-(8 if smoke else 64):]
    train_gen = gen_seqs[:-(8 if smoke else 64)] if not smoke else gen_seqs
    total_s = budget_s - (time.time() - t_start) - 25
    t_train = time.time()
    step = 0
    max_steps = 3 if smoke else 10 ** 9
    while step < max_steps:
        el = time.time() - t_train
        if el > total_s:
            break
        lr = 1e-3 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, el / total_s))))
        for gp in opt.param_groups:
            gp["lr"] = lr
        src = train_gen if step % 2 == 0 else None
        loss, _ = loss_of(batch(step_gen, src), step_gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 200 == 0:
            rec = {"step": step, "t": time.time() - t_start, "loss": float(loss), "lr": lr}
            print(json.dumps(rec), flush=True)
            log["curve"].append(rec)
        step += 1
    log["steps"] = step
    with torch.no_grad():
        ev = {}
        for name, src in (("heldout_text", held_windows), ("heldout_gen", eval_gen_seqs)):
            loss, st = loss_of(src, torch.Generator().manual_seed(11), stats=True)
            ev[name] = {"loss": float(loss), **st}
        log["eval"] = ev
    print(json.dumps(log["eval"]), flush=True)
    arrs = {"fc.weight": W["fc"], "enc.output_norm.weight": W["enc.output_norm"],
            "output_norm.weight": W["output_norm"]}
    for il, L in enumerate(W["layers"]):
        for n, p in L.items():
            arrs[f"blk.{il}.{n}.weight"] = p
    np.savez(out / "drafter-weights.npz", **{k: v.detach().float().cpu().numpy() for k, v in arrs.items()})
    log["status"] = "done"
    log["total_s"] = time.time() - t_start
    (out / "drafter-train-log.json").write_text(json.dumps(log, indent=1))
    return 0


# ---------------------------------------------------------------------------------------------
# export (here)

def export(weights: Path, data: Path, target: Path, out: Path) -> int:
    from muser.gguf.identity import identity_of, write_pin
    from muser.gguf.reader import read_gguf
    from muser.spec.format import write_drafter

    meta = json.loads((data / "meta.json").read_text())
    log = json.loads((weights / "drafter-train-log.json").read_text())
    arrs = dict(np.load(weights / "drafter-weights.npz"))
    f = read_gguf(target)
    d = meta["draft"]
    geo = dict(d, hidden=meta["target_geometry"]["hidden"], context_length=meta["target_geometry"]["context_length"],
               name="muse-glimmer-micro-dflash",
               provenance=json.dumps({"target_sha256": meta["target_sha256"], "streams": meta["streams"],
                                      "steps": log["steps"], "eval": log["eval"], "train_s": log["total_s"]},
                                     sort_keys=True))
    write_drafter(out, geo, arrs, f, dtype="F16")
    f.close()
    g = read_gguf(out)
    ident = identity_of(g, ())
    g.close()
    write_pin(ident, out.with_name(out.name[: -len(".gguf")] + ".pin.json"))
    print(out, out.stat().st_size, "bytes", ident.artifact_sha256)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--root", type=Path)
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--target", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--budget-s", type=float, default=420.0)
    t.add_argument("--smoke", action="store_true")
    e = sub.add_parser("export")
    e.add_argument("--weights", type=Path, required=True)
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("--target", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        return prepare(a.target, a.out, a.root)
    if a.cmd == "train":
        return train(a.data, a.target, a.out, a.budget_s, a.smoke)
    return export(a.weights, a.data, a.target, a.out)


if __name__ == "__main__":
    sys.exit(main())
