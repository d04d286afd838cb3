#!/usr/bin/env python3
"""The micro model's DFlash drafter (book ch. 8): distilled from the target on the GPU machine, in the
same call that trains the target (tools/device_train.py calls `distill`), exported here:

    tools/train_drafter.py export --weights RUN_OUT --target models/muse-glimmer-micro-q8_0.gguf \
        --out models/muse-glimmer-micro-dflash.gguf
        the sidecar GGUF (muser.spec.format.write_drafter, F16 weights) and its .pin.json, from
        RUN_OUT/drafter-weights.npz and RUN_OUT/micro-run.json (its "drafter" record)

Distillation targets are the target model's own greedy outputs: (a) greedy continuations the target
generates from prompts cut out of the train split (where the text IS the target's greedy path), and
(b) train-split windows, each position labelled with the target's argmax there. The drafter sees the
target's layer-input residuals at its target layers for every context position (the F16 master's
values, TF32 matmuls, the graph of src/models/muse-glimmer.cpp via tools/micro_net.py) and learns to
fill the block [x_n, <mask> x 15] at positions n..n+15 with the target's greedy tokens for positions
n+1..n+15; the context of a block is every position before n (the drafter's context ABI: sink 64 +
window 2048 covers the micro model's whole context). Loss: cross-entropy per block row, weighted
0.9^(row-1) (acceptance is prefix-bound). Embedding and LM head are the target's (shared, frozen, not
shipped).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from train_micro import STOP  # noqa: E402

# drafter geometry; hidden and FFN width are the target's, target_layers follow its depth
DRAFT = {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "block_size": 16,
         "window": 2048, "rope_base": 10000.0, "eps": 1e-6}
SEQ = 512  # training sequence length (prompt + greedy continuation, or a train window)
ANCHORS = 16  # blocks per sequence per step


# ---------------------------------------------------------------------------------------------
# distill (GPU machine)

def capture_layers(n_layers: int) -> list[int]:
    """The target layers whose input residuals feed the drafter: early, middle, last (8 -> [1, 4, 7])."""
    return [1, n_layers // 2, n_layers - 1]


def draft_geometry(target_geo) -> dict:
    """The drafter's geometry for a target (hidden and FFN width are the target's)."""
    return dict(DRAFT, ffn=target_geo.ffn, target_layers=capture_layers(target_geo.n_layers))


def distill(target, geo, train_ids, held_ids, mask_id: int, budget_s: float, smoke: bool = False,
            log=print) -> tuple[dict, dict]:
    """Train a drafter for `target` (a micro_net.MicroGlimmer on its device, eval mode) within budget_s
    wall seconds on the int64 CPU streams train_ids / held_ids. Returns (tensors: GGUF name -> f32
    numpy array in numpy order, record: geometry, curve, held-out acceptance)."""
    import torch
    import torch.nn.functional as F
    import micro_net as mn

    from muser.spec.net import NetGeometry, block_hidden, context_kv, fuse

    t_start = time.time()
    dev = next(target.parameters()).device
    # TF32 matmuls for the target's features and greedy labels (fp32 storage and accumulation)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    target.eval().requires_grad_(False)
    D = draft_geometry(geo)
    layers = list(D["target_layers"])
    H = geo.hidden

    def target_pass(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (features [B, T, n_cap*H] f32, greedy labels [B, T]: argmax at each position)."""
        x = mn.rms(F.embedding(ids, target.token_embd), geo.rms_eps)
        caps = []
        for il, b in enumerate(target.blocks):
            if il in layers:
                caps.append(x)
            x = b(x, target.cos, target.sin, target.mask)
        x = mn.rms(x, geo.rms_eps) * target.output_norm
        logits = F.linear(x, target.output)  # scale and softcap are monotone: argmax unchanged
        return torch.cat(caps, -1), logits.argmax(-1)

    seq = 64 if smoke else SEQ
    gen = torch.Generator().manual_seed(1234)

    # (a) greedy continuations from train-split prompts (full recompute; the target is small)
    n_gen_batches, gen_batch = (1, 4) if smoke else (8, 256)
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
            log(f"drafter: gen batch {gb}: prompt {p}, {time.time() - t0:.1f}s")
            if time.time() - t0 > budget_s * 0.2:  # keep most of the budget for training
                break
    gen_seqs = torch.cat(gen_seqs)
    t_gen = time.time() - t0

    ng = NetGeometry(H, D["n_layers"], D["n_heads"], D["n_kv_heads"], D["head_dim"], D["ffn"],
                     len(layers), D["head_dim"], D["rope_base"], D["eps"], 1.0 / math.sqrt(D["head_dim"]), 0.0, 0.0)
    pgen = torch.Generator().manual_seed(7)

    def P(*shape, scale=None, ones=False):
        if ones:
            return torch.nn.Parameter(torch.ones(*shape, device=dev))
        w = torch.randn(*shape, generator=pgen) / math.sqrt(shape[1] if scale is None else scale)
        return torch.nn.Parameter(w.to(dev))

    hd, nh, nkv, ff = D["head_dim"], D["n_heads"], D["n_kv_heads"], D["ffn"]
    W = {"fc": P(H, len(layers) * H), "enc.output_norm": P(H, ones=True), "output_norm": P(H, ones=True),
         "layers": []}
    for _ in range(D["n_layers"]):
        W["layers"].append({"attn_norm": P(H, ones=True), "attn_q": P(nh * hd, H), "attn_k": P(nkv * hd, H),
                            "attn_v": P(nkv * hd, H), "attn_output": P(H, nh * hd, scale=nh * hd * 4),
                            "attn_q_norm": P(hd, ones=True), "attn_k_norm": P(hd, ones=True),
                            "ffn_norm": P(H, ones=True), "ffn_gate": P(ff, H), "ffn_up": P(ff, H),
                            "ffn_down": P(H, ff, scale=ff * 4)})
    params = [W["fc"], W["enc.output_norm"], W["output_norm"]] + [p for L in W["layers"] for p in L.values()]
    n_params = sum(p.numel() for p in params)
    log(f"drafter: {n_params:,} params, geometry {D}")
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    mask_tok = mask_id
    B = 4 if smoke else 48
    A = 4 if smoke else ANCHORS
    K = D["block_size"]
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

    rec = {"status": "running", "draft": D, "n_params": n_params, "seq": seq, "batch": B, "anchors": A,
           "gen_sequences": int(gen_seqs.shape[0]), "gen_s": round(t_gen, 2), "budget_s": budget_s,
           "target_matmul": "tf32", "curve": []}
    step_gen, eval_gen = torch.Generator().manual_seed(99), torch.Generator().manual_seed(5)
    n_eval = 8 if smoke else 64
    held_windows = torch.stack([held_ids[s:s + seq] for s in
                                torch.randint(0, held_ids.numel() - seq, (n_eval,), generator=eval_gen).tolist()])
    eval_gen_seqs = gen_seqs[-n_eval:]
    train_gen = gen_seqs if smoke else gen_seqs[:-n_eval]
    total_s = budget_s - (time.time() - t_start) - 10  # the evaluation below
    t_train = time.time()
    step = 0
    max_steps = 3 if smoke else 10 ** 9
    while step < max_steps and not STOP["why"]:
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
            pt = {"step": step, "t": round(time.time() - t_start, 2), "loss": float(loss.detach()), "lr": lr}
            log("drafter: " + json.dumps(pt))
            rec["curve"].append(pt)
        step += 1
    rec["steps"] = step
    rec["train_s"] = round(time.time() - t_train, 2)
    with torch.no_grad():
        ev = {}
        for name, src in (("heldout_text", held_windows), ("heldout_gen", eval_gen_seqs)):
            loss, st = loss_of(src, torch.Generator().manual_seed(11), stats=True)
            ev[name] = {"loss": float(loss), **st}
        rec["eval"] = ev
    log("drafter: " + json.dumps(rec["eval"]))
    arrs = {"fc.weight": W["fc"], "enc.output_norm.weight": W["enc.output_norm"], "output_norm.weight": W["output_norm"]}
    for il, L in enumerate(W["layers"]):
        for n, p in L.items():
            arrs[f"blk.{il}.{n}.weight"] = p
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    rec["status"] = "done"
    rec["total_s"] = round(time.time() - t_start, 2)
    return {k: v.detach().float().cpu().numpy() for k, v in arrs.items()}, rec


# ---------------------------------------------------------------------------------------------
# export (here)

def export(weights: Path, target: Path, out: Path) -> int:
    from muser.gguf.identity import identity_of, write_pin
    from muser.gguf.reader import read_gguf
    from muser.spec.format import write_drafter

    run = json.loads((weights / "micro-run.json").read_text())
    rec = run.get("drafter")
    if not rec or rec.get("status") != "done":
        raise SystemExit(f"{weights}/micro-run.json holds no finished drafter record")
    arrs = dict(np.load(weights / "drafter-weights.npz"))
    f = read_gguf(target)
    try:
        tg = {k: f.get(k) for k in f.fields if k.startswith("muse-glimmer.")}
        geo = dict(rec["draft"], hidden=tg["muse-glimmer.embedding_length"],
                   context_length=tg["muse-glimmer.context_length"], name="muse-glimmer-micro-dflash",
                   provenance=json.dumps({"target_weights": run["weights"]["shards"], "corpus": run["corpus"]["streams"],
                                          "steps": rec["steps"], "eval": rec["eval"], "train_s": rec["train_s"]},
                                         sort_keys=True))
        write_drafter(out, geo, arrs, f, dtype="F16")
        out.chmod(0o644)  # the writer's temp file is private; a shipped file is world-readable
    finally:
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
    e = sub.add_parser("export")
    e.add_argument("--weights", type=Path, required=True, help="the device run's output folder")
    e.add_argument("--target", type=Path, required=True, help="the exported target GGUF (vocabulary, geometry)")
    e.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    return export(a.weights, a.target, a.out)


if __name__ == "__main__":
    sys.exit(main())
