#!/usr/bin/env python3
"""The micro model's DFlash drafter (book ch. 8): distilled from the target on the GPU machine, exported here.

    tools/train_drafter.py carry [--out .device/drafter]
        here: the text the device run reads (a deterministic half of the stdlib train split and the whole
        stdlib held-out split, muser.corpus rule), xz-framed, the held-out prompts of `muser bench spec`'s
        classes (its code, the target's tokenizer), with drafter-carry.json (hashes, counts, the
        vocabulary's line-ending ids)
    bash tools/device_train.sh drafter       (on one H200; runs `distill-device`, see that script)
    tools/train_drafter.py distill-device --target models/muse-glimmer-micro-q8_0.gguf --carry .device/drafter \
        --out OUT [--deadline-s 380] [--baseline models/muse-glimmer-micro-dflash.gguf] [--smoke]
        the shipped Q8_0 target dequantized (muser.gguf + muser.quant) into tools/micro_net.py's graph,
        the carried text tokenized with the GGUF's own vocabulary, then `distill`; writes
        OUT/drafter-weights.npz and OUT/drafter-run.json (rewritten after each stage)
    tools/train_drafter.py export --weights RUN_OUT --target models/muse-glimmer-micro-q8_0.gguf \
        --out models/muse-glimmer-micro-dflash.gguf
        the sidecar GGUF (muser.spec.format.write_drafter, F16 weights) and its .pin.json, from
        RUN_OUT/drafter-weights.npz and RUN_OUT/drafter-run.json (or, for a whole training run,
        RUN_OUT/micro-run.json's "drafter" record)
    tools/train_drafter.py score [--target T --drafter D] [--max-tokens 64] [--heldout 8] [--out JSON]
        here, on the CPU: the training code's acceptance on the prompts of `muser bench spec` and on the
        evaluation's held-out prompts, by the evaluation's rule (every anchor) and by the bench's (per
        greedy round, every round drafting; tests/micro/test_drafter.py checks these are Muser's rounds)

`distill` (also the last stage of tools/device_train.py, on a freshly trained master):
  1. greedy continuations of the target, KV-cached and batched (MicroGlimmer.greedy, f32 matmuls with
     TF32 off, so the labels are the target's own argmax up to the rare flip that dequantized f32
     arithmetic against ggml's Q8_0 activation rounding can cause): groups of sequences, one prompt
     length per group, DistillConfig.gen_new (80) tokens each. The prompts are drawn from the TRAIN split
     like `muser bench spec`'s classes (TrainPrompts): file starts ([BOS] + a file's first tokens, the
     natural class) and cuts at line boundaries inside files (natural-mid's boundary rule), plus windows
     at random offsets of the stream; the bench's own held-out prompts (natural, natural-mid, synthetic,
     built by its code into the carry) are continued for the per-round evaluation;
  2. the drafter trained on them: the drafter sees the target's layer-input residuals at its target
     layers for every context position (TF32 matmuls) and learns to fill the block [x_n, <mask> x 15] at
     positions n..n+15 with the target's greedy tokens n+1..n+15; anchors n lie in the generated part
     (n >= prompt - 1), where those tokens ARE the target's greedy path from n, half of them in the first
     rounds' span right after the prompt (where the bench's rounds start); the context of a block
     is every position before n (the drafter's context ABI: sink 64 + window 2048 covers the micro
     model's whole context). Loss: cross-entropy per block row, weighted 0.9^(row-1) (acceptance is
     prefix-bound), plus KL from the target's softmax at T = 0.7 (its logits come from the same forward
     that captures the features) for sampled verification. Embedding and LM head are the target's
     (shared, frozen, not shipped);
  3. evaluation: the bench's per-round metric (mean accepted per greedy round of 64 tokens, every round
     drafting, verify length 15 and 7) on the held-out bench-class prompts; on greedy continuations of
     held-out prompts at random offsets (the stdlib held-out split) and of train prompts not trained on:
     mean accepted length of 15 (and of 7, the default verify length), top-1 per block row, every anchor
     of the generated part, the expected accepted length under T = 0.7; optionally the same for a
     baseline drafter GGUF.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tools"))

from train_micro import STOP, on_signal, write_json  # noqa: E402

# drafter geometry; hidden and FFN width are the target's, target_layers follow its depth
DRAFT = {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "block_size": 16,
         "window": 2048, "rope_base": 10000.0, "eps": 1e-6}
CARRY = REPO / ".device" / "drafter"
CARRY_MANIFEST = "drafter-carry.json"
BENCH_FILE = "bench-heldout.u16"
TARGET = REPO / "models" / "muse-glimmer-micro-q8_0.gguf"
RUN_RECORD = "drafter-run.json"
WEIGHTS = "drafter-weights.npz"


# the prompt classes a training group is drawn from (TrainPrompts): file starts and cuts at line
# boundaries inside files (the bench's natural / natural-mid classes, muser.bench.kinds.spec), and
# windows at random offsets of the stream
PROMPT_CLASSES = ("start", "mid", "offset")
BENCH_PROMPT_TOKENS = 256  # muser bench spec --prompt-tokens (its default)
TRAIN_PROMPT_RULE = ("the carried train split only; per group a class drawn by class_mix and a length p uniform in "
                     "[prompt_min, prompt_max]: start = [BOS] + a file's first p - 1 ids, mid = [BOS] + the p - 1 "
                     "ids ending at a line boundary of a file (a token whose bytes end in a newline), offset = "
                     "p ids at a uniform random offset of the stream")


@dataclass
class DistillConfig:
    """Sizes of one distillation (the defaults are the H200 run's; SMOKE_DISTILL the CPU smoke's)."""
    gen_new: int = 80  # greedy tokens generated after each prompt (the bench generates 64)
    prompt_min: int = 32  # prompt lengths drawn per group from [prompt_min, prompt_max]
    prompt_max: int = 320
    class_mix: tuple[float, float, float] = (0.4, 0.4, 0.2)  # P(group class), PROMPT_CLASSES order
    gen_batch: int = 2048  # sequences per group (one greedy call; a file-start group: one per eligible file)
    gen_seqs: int = 98304  # training sequences wanted (generation stops earlier at gen_frac of the budget)
    gen_frac: float = 0.3
    held_groups: int = 4  # held-out prompts at random offsets: groups x held_batch sequences
    held_batch: int = 128
    check_batch: int = 256  # train mid-file prompts generated but never trained on (in-distribution check)
    bench_new: int = 64  # tokens the per-round metric covers on the held-out bench-class prompts
    bench_per_class: int = 0  # held-out bench-class prompts kept per class (0: all the carry holds)
    batch: int = 128  # sequences per step
    anchors: int = 32  # blocks per sequence per step
    first_frac: float = 0.5  # share of the anchors drawn from the first rounds: [p - 1, p - 1 + first_span)
    first_span: int = 16
    kd_weight: float = 0.5  # weight of KL(target softmax at kd_temp || drafter's) beside the greedy CE
    kd_temp: float = 0.7  # the bench's sampled mode (T = 0.7)
    lr: float = 1.5e-3
    warmup: int = 100
    eval_every_s: float = 30.0
    eval_batch: int = 64  # sequences per evaluation chunk
    max_steps: int = 10 ** 9
    reserve_s: float = 30.0  # kept for the final evaluation


SMOKE_DISTILL = DistillConfig(gen_new=24, prompt_min=8, prompt_max=24, class_mix=(0.5, 0.5, 0.0), gen_batch=4,
                              gen_seqs=8, gen_frac=0.9, held_groups=1, held_batch=4, check_batch=4, bench_new=12,
                              bench_per_class=2, batch=4, anchors=4, first_span=4, warmup=2, eval_every_s=0.0,
                              eval_batch=4, max_steps=3, reserve_s=1.0)


# ---------------------------------------------------------------------------------------------
# distill (GPU machine)

def capture_layers(n_layers: int) -> list[int]:
    """The target layers whose input residuals feed the drafter: early, middle, last (8 -> [1, 4, 7])."""
    return [1, n_layers // 2, n_layers - 1]


def draft_geometry(target_geo) -> dict:
    """The drafter's geometry for a target (hidden and FFN width are the target's)."""
    return dict(DRAFT, ffn=target_geo.ffn, target_layers=capture_layers(target_geo.n_layers))


def net_geometry(D: dict, hidden: int):
    from muser.spec.net import NetGeometry

    return NetGeometry(hidden, D["n_layers"], D["n_heads"], D["n_kv_heads"], D["head_dim"], D["ffn"],
                       len(D["target_layers"]), D["head_dim"], D["rope_base"], D["eps"],
                       1.0 / math.sqrt(D["head_dim"]), 0.0, 0.0)


def init_drafter(D: dict, hidden: int, dev, seed: int = 7) -> dict:
    """Fresh drafter parameters (muser.spec.net's W layout): scaled normal matrices, unit norms."""
    import torch

    pgen = torch.Generator().manual_seed(seed)

    def P(*shape, scale=None, ones=False):
        if ones:
            return torch.nn.Parameter(torch.ones(*shape, device=dev))
        w = torch.randn(*shape, generator=pgen) / math.sqrt(shape[1] if scale is None else scale)
        return torch.nn.Parameter(w.to(dev))

    H, hd, nh, nkv, ff = hidden, D["head_dim"], D["n_heads"], D["n_kv_heads"], D["ffn"]
    W: dict = {"fc": P(H, len(D["target_layers"]) * H), "enc.output_norm": P(H, ones=True),
               "output_norm": P(H, ones=True), "layers": []}
    for _ in range(D["n_layers"]):
        W["layers"].append({"attn_norm": P(H, ones=True), "attn_q": P(nh * hd, H), "attn_k": P(nkv * hd, H),
                            "attn_v": P(nkv * hd, H), "attn_output": P(H, nh * hd, scale=nh * hd * 4),
                            "attn_q_norm": P(hd, ones=True), "attn_k_norm": P(hd, ones=True),
                            "ffn_norm": P(H, ones=True), "ffn_gate": P(ff, H), "ffn_up": P(ff, H),
                            "ffn_down": P(H, ff, scale=ff * 4)})
    return W


def gguf_names(W: dict) -> dict:
    """W -> {GGUF tensor name: tensor} (muser.spec.format's names)."""
    out = {"fc.weight": W["fc"], "enc.output_norm.weight": W["enc.output_norm"], "output_norm.weight": W["output_norm"]}
    for il, L in enumerate(W["layers"]):
        for n, p in L.items():
            out[f"blk.{il}.{n}.weight"] = p
    return out


def drafter_from_gguf(path: str | Path, D: dict, hidden: int, dev) -> dict:
    """A drafter GGUF's tensors in W's layout (f32 on dev), shapes checked against geometry D."""
    import torch

    from muser.quant import dequantize_tensor
    from muser.spec.format import open_drafter

    f, cfg = open_drafter(path)
    try:
        W = init_drafter(D, hidden, "cpu")
        for name, p in gguf_names(W).items():
            a = dequantize_tensor(f, name)
            if tuple(a.shape) != tuple(p.shape):
                raise SystemExit(f"{path}: tensor {name} has shape {list(a.shape)}, geometry {D} wants {list(p.shape)}")
            p.data = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    finally:
        f.close()
    if list(cfg.target_layers) != list(D["target_layers"]):
        raise SystemExit(f"{path}: target layers {list(cfg.target_layers)}, geometry wants {D['target_layers']}")
    return {k: (v.to(dev) if k != "layers" else [{n: t.to(dev) for n, t in L.items()} for L in v]) for k, v in W.items()}


def training_pair(target_path, drafter_path, dev):
    """A shipped target and its drafter GGUF as this code builds them: (target net, GGUF facts, draft
    geometry, net geometry, drafter weights)."""
    target, geo, facts = load_target(target_path, dev)
    D = draft_geometry(geo)
    return target, facts, D, net_geometry(D, geo.hidden), drafter_from_gguf(drafter_path, D, geo.hidden, dev)


def draw_prompts(stream, cfg: DistillConfig, batch: int, gen) -> tuple[int, object]:
    """One group's prompts: a length p drawn uniformly from [prompt_min, prompt_max], then `batch` windows
    of `stream` (int64 CPU) at uniform random offsets -> (p, prompts [batch, p] int64 CPU)."""
    import torch

    p = int(torch.randint(cfg.prompt_min, cfg.prompt_max + 1, (1,), generator=gen))
    starts = torch.randint(0, stream.numel() - p, (batch,), generator=gen)
    return p, torch.stack([stream[s:s + p] for s in starts.tolist()])


class TrainPrompts:
    """Prompts like those of `muser bench spec`, cut from a stream of documents ([BOS] ids [EOS] each,
    tools/corpus_carry.py encode) of the TRAIN split: "start" = [BOS] + a file's first p - 1 ids (the
    natural class, muser.bench.kinds.spec.start_prompts), "mid" = [BOS] + the p - 1 ids ending at a line
    boundary inside a file (natural-mid's boundary rule, spec.ends_line: the carry lists the vocabulary's
    line-ending ids; every boundary with p - 1 ids of its file before it, not only the midpoint's, and
    no round-trip check: that only matters to a comparator given the text), "offset" = a window at a
    uniform random offset of the stream (draw_prompts)."""

    def __init__(self, stream, bos: int, line_end_ids: list[int]):
        import torch

        self.stream, self.bos = stream, bos
        n = stream.numel()
        bos_at = (stream == bos).nonzero().flatten()  # one per document: specials are not parsed in text
        self.doc_start = bos_at + 1  # a document's first id
        self.doc_end = torch.cat((bos_at[1:], torch.tensor([n]))) - 1  # its EOS (exclusive end of its ids)
        ends = torch.isin(stream, torch.tensor(line_end_ids, dtype=stream.dtype)).nonzero().flatten() + 1
        doc = torch.searchsorted(bos_at, ends - 1, right=True) - 1  # the document holding token end - 1
        keep = doc >= 0
        self.cut_end, self.cut_doc = ends[keep], doc[keep]  # a cut keeps ids [.., end) of its document

    def eligible(self, cls: str, p: int):
        """Indices of the documents (start) or cuts (mid) that have p - 1 ids for a prompt of length p."""
        if cls == "start":
            return ((self.doc_end - self.doc_start) >= p - 1).nonzero().flatten()
        return ((self.cut_end - self.doc_start[self.cut_doc]) >= p - 1).nonzero().flatten()

    def draw(self, cls: str, cfg: DistillConfig, batch: int, gen) -> tuple[int, object]:
        """One group of class cls: (p, prompts [b, p] int64 CPU); a start group holds each eligible file
        at most once (b = min(batch, eligible files)), a mid group distinct cuts where there are enough.
        A class with nothing eligible at the drawn p falls back to offsets."""
        import torch

        if cls == "offset":
            return draw_prompts(self.stream, cfg, batch, gen)
        p = int(torch.randint(cfg.prompt_min, cfg.prompt_max + 1, (1,), generator=gen))
        idx = self.eligible(cls, p)
        if idx.numel() == 0:
            return draw_prompts(self.stream, cfg, batch, gen)
        if cls == "start" or idx.numel() >= batch:
            pick = idx[torch.randperm(idx.numel(), generator=gen)[:batch]]
        else:
            pick = idx[torch.randint(0, idx.numel(), (batch,), generator=gen)]
        first = self.doc_start[pick] if cls == "start" else self.cut_end[pick] - (p - 1)
        win = first[:, None] + torch.arange(p - 1)
        return p, torch.cat((torch.full((pick.numel(), 1), self.bos, dtype=self.stream.dtype), self.stream[win]), 1)

    def draw_group(self, cfg: DistillConfig, batch: int, gen) -> tuple[str, int, object]:
        """A class drawn by cfg.class_mix, then its group: (class, p, prompts)."""
        import torch

        cls = PROMPT_CLASSES[int(torch.multinomial(torch.tensor(cfg.class_mix), 1, generator=gen))]
        return (cls, *self.draw(cls, cfg, batch, gen))


def generate_groups(target, draw, cfg: DistillConfig, n_groups: int, gen, stop_at: float,
                    log=print) -> tuple[list[tuple[int, object]], list[str]]:
    """Up to n_groups greedy groups (prompt length p, sequences [b, p + gen_new] int64 on the target's
    device), the prompts of each from draw(gen) -> (class, p, prompts [b, p] int64 CPU), and each group's
    class. Stops early at wall time stop_at (after at least one group) or on SIGTERM."""
    import torch

    dev = next(target.parameters()).device
    out: list[tuple[int, object]] = []
    classes: list[str] = []
    for _ in range(n_groups):
        if STOP["why"] or (out and time.time() > stop_at):
            break
        cls, p, prompts = draw(gen)
        out.append((p, target.greedy(prompts.to(dev), cfg.gen_new)))
        classes.append(cls)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    log(f"drafter: generated {len(out)} groups, {sum(int(s.shape[0]) for _, s in out)} sequences "
        f"({', '.join(f'{c} {classes.count(c)}' for c in PROMPT_CLASSES if c in classes)} groups)")
    return out, classes


def target_features(target, layers: list[int], ids, final: bool = False):
    """ids [B, T] -> the target's input residuals at `layers` (what the engine captures), concatenated
    [B, T, n_cap*H] f32; no gradient. final: also the target's last hidden state after its output norm
    [B, T, H] (target_logits turns rows of it into the target's logits)."""
    import torch
    import torch.nn.functional as F

    import micro_net as mn

    g = target.g
    with torch.no_grad():
        x = mn.rms(F.embedding(ids, target.token_embd), g.rms_eps)
        caps = []
        for il, b in enumerate(target.blocks):
            if il in layers:
                caps.append(x)
            if il == max(layers) and not final:
                break
            x = b(x, target.cos, target.sin, target.mask)
        feats = torch.cat(caps, -1)
        return (feats, mn.rms(x, g.rms_eps) * target.output_norm) if final else feats


def target_logits(target, hidden):
    """Rows of target_features' final hidden state [..., H] -> the target's logits [..., vocab] f32 (logit
    scale, then softcap: micro_net.MicroGlimmer.forward)."""
    import torch
    import torch.nn.functional as F

    g = target.g
    with torch.no_grad():
        return g.softcap * torch.tanh(F.linear(hidden, target.output).float() * g.logit_scale / g.softcap)


def drafter_context(W: dict, ng, target, layers: list[int], ids, final: bool = False):
    """The drafter's injected K/V, per draft layer, for every position of ids [B, T] (bf16 on CUDA);
    final: (that, the target's final hidden state [B, T, H], target_features)."""
    import torch

    from muser.spec.net import context_kv, fuse

    feats, last = target_features(target, layers, ids, final=True) if final else (
        target_features(target, layers, ids), None)
    B, T = ids.shape
    pos = torch.arange(T, device=ids.device)[None].expand(B, T)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        fz = fuse(W, feats, ng)
        ctx = [context_kv(W, il, fz, pos, ng) for il in range(ng.n_layers)]
    return (ctx, last) if final else ctx


def row_target_logits(target, last, anchors, K: int):
    """The target's logits behind each row's label: row j of the block at anchor n is labelled with
    ids[n + j], the target's greedy token after position n + j - 1 -> [B, A, K, vocab] f32 (row 0, the
    known token, reads position n - 1 and is never weighted)."""
    import torch

    B, A = anchors.shape
    pos = (anchors[:, :, None] + torch.arange(K, device=anchors.device) - 1).clamp(min=0).reshape(B, A * K)
    rows = torch.gather(last, 1, pos[:, :, None].expand(-1, -1, last.shape[-1]))
    return target_logits(target, rows).view(B, A, K, -1)


def draft_blocks(W: dict, ng, target, ctx: list, ids, anchors, mask_id: int, K: int):
    """Blocks [x_n, <mask> x (K-1)] at anchors [B, A] (n + K - 1 < T), each seeing context positions < n
    and its own block (muser.spec.Drafter.propose, batched) -> (logits [B, A, K, vocab] f32, labels
    [B, A, K]: ids at n..n+K-1; row 0 is the known token)."""
    import torch
    import torch.nn.functional as F

    from muser.spec.net import block_hidden

    dev = ids.device
    B, T = ids.shape
    A = anchors.shape[1]
    qpos = (anchors[:, :, None] + torch.arange(K, device=dev)).reshape(B, A * K)  # [B, A*K]
    toks = torch.full((B, A, K), mask_id, dtype=torch.long, device=dev)
    toks[:, :, 0] = torch.gather(ids, 1, anchors)
    labels = torch.gather(ids, 1, qpos).view(B, A, K)
    ctx_vis = torch.arange(T, device=dev)[None, None, :] < anchors.view(B, A, 1)  # [B, A, T]: positions < n
    ctx_vis = ctx_vis[:, :, None, :].expand(B, A, K, T).reshape(B, A * K, T)
    blk = torch.arange(A, device=dev).repeat_interleave(K)
    blk_vis = (blk[:, None] == blk[None, :])[None].expand(B, A * K, A * K)  # within its own block only
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        emb = F.embedding(toks.view(B, A * K), target.token_embd)
        hid = block_hidden(W, emb, qpos, ctx, ng, torch.cat((ctx_vis, blk_vis), -1))
        logits = F.linear(hid, target.output).float().view(B, A, K, -1)
    return logits, labels


def distill(target, geo, train_ids, held_ids, mask_id: int, budget_s: float, smoke: bool = False,
            log=print, cfg: DistillConfig | None = None, extra: dict | None = None,
            baseline: str | Path | None = None, on_progress=None, on_trained=None,
            prompts: TrainPrompts | None = None, bench: list[tuple[str, str, list[int]]] | None = None
            ) -> tuple[dict, dict]:
    """Train a drafter for `target` (a micro_net.MicroGlimmer on its device) within budget_s wall seconds,
    prompts from the int64 CPU streams train_ids (training) / held_ids (evaluation): with `prompts` (a
    TrainPrompts of train_ids) groups of the bench's classes by cfg.class_mix, else windows at random
    offsets only. `bench`: held-out prompts of the bench's classes (class, name, ids), scored per greedy
    round as `muser bench spec` runs them. Returns (tensors: GGUF name -> f32 numpy array in numpy order,
    record: geometry, sizes, curve, held-out acceptance; `extra` merged in; on_progress(record) after each
    stage; on_trained(tensors) once training ends, before the final evaluation, so a run cut short
    during it still keeps the weights)."""
    import torch
    import torch.nn.functional as F

    t_start = time.time()
    cfg = cfg or (SMOKE_DISTILL if smoke else DistillConfig())
    dev = next(target.parameters()).device
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    target.eval().requires_grad_(False)
    D = draft_geometry(geo)
    layers = list(D["target_layers"])
    H, K = geo.hidden, D["block_size"]
    ng = net_geometry(D, H)
    rec: dict = {"status": "running", "draft": D, "config": asdict(cfg), "budget_s": budget_s,
                 "target_matmul": {"generation": "f32 (TF32 off)", "features": "tf32", "drafter": "bf16 autocast"
                                   if dev.type == "cuda" else "f32"}, "curve": [], **(extra or {})}
    progress = on_progress or (lambda r: None)

    def offsets(stream, batch: int):
        return lambda g: ("offset", *draw_prompts(stream, cfg, batch, g))

    # 1. greedy continuations, f32: the labels are the target's own argmax
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    t0 = time.time()
    gen = torch.Generator().manual_seed(1234)  # the held-out groups are its first draws (score repeats them)
    held, _ = generate_groups(target, offsets(held_ids, cfg.held_batch), cfg, cfg.held_groups, gen, math.inf, log)
    check, check_cls = generate_groups(target, offsets(train_ids, cfg.check_batch) if prompts is None else
                                       (lambda g: ("mid", *prompts.draw("mid", cfg, cfg.check_batch, g))),
                                       cfg, 1, gen, math.inf, log)
    pool, pool_cls = generate_groups(target, offsets(train_ids, cfg.gen_batch) if prompts is None else
                                     (lambda g: prompts.draw_group(cfg, cfg.gen_batch, g)),
                                     cfg, max(1, -(-cfg.gen_seqs // cfg.gen_batch)), gen,
                                     t_start + cfg.gen_frac * budget_s, log)
    bench_groups = []  # (class, names, p, sequences [b, p + bench_new + K]): labels for every anchor of the rounds
    for cls in ("natural", "natural-mid", "synthetic"):
        sel = [(name, ids) for c, name, ids in bench or [] if c == cls][: cfg.bench_per_class or None]
        for p in sorted({len(ids) for _, ids in sel}):
            names = [name for name, ids in sel if len(ids) == p]
            x = torch.tensor([ids for _, ids in sel if len(ids) == p], dtype=torch.long, device=dev)
            if not STOP["why"]:
                bench_groups.append((cls, names, p, target.greedy(x, cfg.bench_new + K)))
    t_gen = time.time() - t0
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if not (held and check and pool):  # SIGTERM during generation: nothing to train on
        rec.update(status=f"stopped during generation ({STOP['why']})", gen={"s": round(t_gen, 2)})
        return {}, rec
    n_pool = sum(int(s.shape[0]) for _, s in pool)
    rec["gen"] = {"s": round(t_gen, 2), "train_sequences": n_pool, "train_groups": len(pool),
                  "prompt_lengths": [p for p, _ in pool], "classes": pool_cls,
                  "class_sequences": {c: sum(int(s.shape[0]) for (_, s), k in zip(pool, pool_cls) if k == c)
                                      for c in PROMPT_CLASSES},
                  "new_tokens": cfg.gen_new, "train_generated_tokens": n_pool * cfg.gen_new,
                  "heldout_sequences": sum(int(s.shape[0]) for _, s in held),
                  "check_sequences": int(check[0][1].shape[0]), "check_class": check_cls[0],
                  "bench_heldout_prompts": {c: sum(len(n) for k, n, _, _ in bench_groups if k == c)
                                            for c in ("natural", "natural-mid", "synthetic")},
                  "tokens_per_s": round((n_pool + sum(int(s.shape[0]) for _, s in held + check)) * cfg.gen_new
                                        / max(t_gen, 1e-9))}
    log("drafter: generation " + json.dumps({k: v for k, v in rec["gen"].items() if k not in ("classes",)}))
    progress(rec)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    W = init_drafter(D, H, dev)
    params = [W["fc"], W["enc.output_norm"], W["output_norm"]] + [p for L in W["layers"] for p in L.values()]
    rec["n_params"] = sum(p.numel() for p in params)
    log(f"drafter: {rec['n_params']:,} params, geometry {D}")
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    row_w = torch.tensor([0.0] + [0.9 ** (i - 1) for i in range(1, K)], device=dev)
    kd_t = cfg.kd_temp

    def context(Wd, ids, final: bool = False):
        return drafter_context(Wd, ng, target, layers, ids, final=final)

    def blocks(Wd, ctx, ids, anchors):
        return draft_blocks(Wd, ng, target, ctx, ids, anchors, mask_id, K)

    def weighted_ce(logits, labels):
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return (ce.view(labels.shape) * row_w).sum() / (row_w.sum() * labels.shape[0] * labels.shape[1])

    def weighted_kd(logits, tlogits):
        """KL(target softmax at kd_temp || drafter softmax at kd_temp) per row, weighted as the CE, times
        kd_temp^2 (the gradient scale of the hard term; Hinton et al.). A greedy drafter proposes a point
        mass, which T = 0.7 verification accepts with the target's probability of it."""
        kl = F.kl_div(F.log_softmax(logits / kd_t, -1), F.log_softmax(tlogits / kd_t, -1), reduction="none",
                      log_target=True).sum(-1)  # [B, A, K]
        return kd_t * kd_t * (kl * row_w).sum() / (row_w.sum() * kl.shape[0] * kl.shape[1])

    def evaluate(Wd, groups, stride: int = 1, max_seqs: int | None = None) -> dict:
        """Every stride-th anchor of the generated part (n from p-1 to T-K) of each group's sequences:
        mean accepted prefix of the 15 proposals and of the first 7, top-1 per row, weighted CE, and the
        expected accepted prefix of the first 7 under T = kd_temp verification along the greedy path
        (sum over j of the product of the target's probabilities of the drafter's proposals 1..j)."""
        n_blk, loss_sum, acc15, acc7, samp7 = 0, 0.0, 0.0, 0.0, 0.0
        rows = torch.zeros(K - 1, dtype=torch.float64, device=dev)
        with torch.no_grad():
            for p, seqs in groups:
                if STOP["why"] and n_blk:  # SIGTERM: what is measured so far, then save
                    break
                seqs = seqs[:max_seqs]
                T = seqs.shape[1]
                an = torch.arange(p - 1, T - K + 1, stride, device=dev)
                for i in range(0, seqs.shape[0], cfg.eval_batch):
                    ids = seqs[i:i + cfg.eval_batch]
                    ctx, last = context(Wd, ids, final=True)
                    for j in range(0, an.numel(), cfg.anchors):
                        a = an[j:j + cfg.anchors][None].expand(ids.shape[0], -1)
                        logits, labels = blocks(Wd, ctx, ids, a)
                        prop = logits.argmax(-1)
                        hit = (prop == labels)[:, :, 1:]  # [B, A, 15]
                        run = hit.int().cumprod(-1)
                        pt = torch.softmax(row_target_logits(target, last, a, K) / kd_t, -1)
                        pd = torch.gather(pt, -1, prop[..., None])[..., 0][:, :, 1:8]  # [B, A, 7]
                        nb = hit.shape[0] * hit.shape[1]
                        loss_sum += float(weighted_ce(logits, labels)) * nb
                        acc15 += float(run.sum())
                        acc7 += float(run[:, :, :7].sum())
                        samp7 += float(pd.double().cumprod(-1).sum())
                        rows += hit.double().sum((0, 1))
                        n_blk += nb
        n = max(n_blk, 1)
        return {"blocks": n_blk, "loss": round(loss_sum / n, 4), "mean_accepted_15": round(acc15 / n, 4),
                "mean_accepted_7": round(acc7 / n, 4), f"expected_accepted_7_t{kd_t}": round(samp7 / n, 4),
                "top1_row1": round(float(rows[0]) / n, 4), "top1_by_row": [round(float(r) / n, 4) for r in rows]}

    def bench_eval(Wd, max_prompts: int | None = None) -> dict:
        """The bench's per-round metric on the held-out bench-class prompts: mean accepted per greedy round
        of bench_new tokens, every round drafting, verify length 15 and 7 (round_lengths over anchor_hits,
        the rounds muser.spec.SpecSession commits), per class and natural + natural-mid pooled."""
        out: dict = {}
        pooled: dict[int, list[int]] = {15: [], 7: []}
        for cls, names, p, seqs in bench_groups:
            if STOP["why"] and out:
                break
            seqs = seqs[:max_prompts]
            hits = torch.cat([anchor_hits(Wd, ng, target, layers, seqs[i:i + cfg.eval_batch], p, cfg.bench_new + 1,
                                          mask_id, K, chunk=cfg.anchors) for i in range(0, seqs.shape[0], cfg.eval_batch)])
            run = hits.int().cumprod(-1)  # [B, bench_new + 1, 15]: anchors p - 1 .. p - 1 + bench_new
            r = out.setdefault(cls, {"prompts": 0, "first_prompts": names[:3]})
            r["prompts"] += int(seqs.shape[0])
            for k in (15, 7):
                rl = [x for acc in run[:, :, :k].sum(-1) for x in round_lengths(acc[1:].tolist(), cfg.bench_new, k)]
                r.setdefault(f"_rl{k}", []).extend(rl)
                if cls != "synthetic":
                    pooled[k].extend(rl)
            r.setdefault("_ev7", []).append(run[:, : cfg.bench_new - K + 2, :7].sum(-1).float().flatten())
        for cls, r in out.items():
            for k in (15, 7):
                rl = r.pop(f"_rl{k}")
                r[f"rounds_{k}"], r[f"per_round_accepted_of_{k}"] = len(rl), round(sum(rl) / max(len(rl), 1), 3)
            r["every_anchor_accepted_of_7"] = round(float(torch.cat(r.pop("_ev7")).mean()), 3)
        out["natural+natural-mid"] = {f"per_round_accepted_of_{k}": round(sum(v) / max(len(v), 1), 3)
                                      for k, v in pooled.items()}
        return out

    sizes = torch.tensor([float(s.shape[0]) for _, s in pool])
    step_gen = torch.Generator().manual_seed(99)
    n_first = round(cfg.anchors * cfg.first_frac)
    t_train = time.time()
    total_s = budget_s - (t_train - t_start) - cfg.reserve_s
    rec["train_budget_s"] = round(total_s, 2)
    step, last_eval = 0, t_train
    while step < cfg.max_steps and not STOP["why"]:
        el = time.time() - t_train
        if el > total_s:
            break
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, el / total_s))))
        for gp in opt.param_groups:
            gp["lr"] = lr
        p, seqs = pool[int(torch.multinomial(sizes, 1, generator=step_gen))]
        ids = seqs[torch.randint(0, seqs.shape[0], (cfg.batch,), generator=step_gen).to(dev)]
        T = ids.shape[1]
        # the bench's rounds start right after the prompt: n_first anchors from the first rounds' span
        anchors = torch.cat((torch.randint(p - 1, min(p - 1 + cfg.first_span, T - K + 1), (cfg.batch, n_first),
                                           generator=step_gen),
                             torch.randint(p - 1, T - K + 1, (cfg.batch, cfg.anchors - n_first), generator=step_gen)),
                            1).to(dev)
        ctx, last = context(W, ids, final=True) if cfg.kd_weight > 0 else (context(W, ids), None)
        logits, labels = blocks(W, ctx, ids, anchors)
        ce = weighted_ce(logits, labels)
        kd = weighted_kd(logits, row_target_logits(target, last, anchors, K)) if cfg.kd_weight > 0 else ce * 0
        loss = ce + cfg.kd_weight * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step == 1 or time.time() - last_eval >= cfg.eval_every_s:
            pt = {"step": step, "t": round(time.time() - t_start, 2), "loss": round(float(loss.detach()), 4),
                  "ce": round(float(ce.detach()), 4), "kd": round(float(kd.detach()), 4), "lr": lr,
                  "heldout": evaluate(W, held, stride=4, max_seqs=16),
                  "bench_per_round_of_7": {c: r["per_round_accepted_of_7"] for c, r in bench_eval(W, 32).items()}}
            del pt["heldout"]["top1_by_row"]
            log("drafter: " + json.dumps(pt))
            rec["curve"].append(pt)
            rec["steps"] = step
            progress(rec)
            last_eval = time.time()
    rec["steps"] = step
    rec["train_s"] = round(time.time() - t_train, 2)
    rec["sequences_seen"] = step * cfg.batch
    rec["blocks_seen"] = step * cfg.batch * cfg.anchors
    tensors = {k: v.detach().float().cpu().numpy() for k, v in gguf_names(W).items()}
    if step == 0:  # stopped before training: nothing worth keeping or exporting
        rec["status"] = f"no training step ({STOP['why'] or 'no time left'})"
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        return tensors, rec
    if on_trained is not None:
        on_trained(tensors)
    t_eval = time.time()
    cut = 16 if STOP["why"] else None  # SIGTERM leaves seconds: a smaller evaluation, then save
    rec["eval"] = {"bench_heldout": bench_eval(W, cut), "heldout_gen": evaluate(W, held, max_seqs=cut),
                   "train_gen_unseen": evaluate(W, check, max_seqs=cut),
                   "train_gen_pool": evaluate(W, [(p, s[: cfg.check_batch]) for p, s in pool[:1]], max_seqs=cut)}
    if baseline is not None and not STOP["why"]:
        try:
            Wb = drafter_from_gguf(baseline, D, H, dev)
            rec["baseline"] = {"gguf": Path(baseline).name, "bench_heldout": bench_eval(Wb),
                               "heldout_gen": evaluate(Wb, held)}
        except SystemExit as e:  # a baseline of another geometry: recorded, not fatal
            rec["baseline"] = {"gguf": Path(baseline).name, "error": str(e)}
    rec["eval_s"] = round(time.time() - t_eval, 2)
    log("drafter: eval " + json.dumps(rec["eval"]))
    if "baseline" in rec:
        log("drafter: baseline " + json.dumps(rec["baseline"]))
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    rec["status"] = "done"
    rec["total_s"] = round(time.time() - t_start, 2)
    return tensors, rec


def save_weights(out: str | Path, arrs: dict) -> str:
    """OUT/drafter-weights.npz: 2-D tensors F16 (what the sidecar GGUF stores), norms F32; its SHA-256."""
    path = Path(out) / WEIGHTS
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **{k: v.astype("<f2") if v.ndim == 2 else v.astype("<f4") for k, v in arrs.items()})
    os.replace(tmp, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# the carry (here) and the drafter-only device run

def write_carry(out: Path = CARRY, root: Path | None = None, target: Path = TARGET) -> dict:
    """OUT/train.xz (the stdlib train split's files at even positions in corpus order) and OUT/heldout.xz
    (the whole stdlib held-out split), framed (muser.corpus.frame) and xz-compressed; OUT/bench-heldout.u16:
    the held-out split's prompts of `muser bench spec`'s classes, built by its own code with the target
    GGUF's tokenizer (every natural prompt of BENCH_PROMPT_TOKENS, every natural-mid cut of those files,
    the synthetic prompt; little-endian uint16, back to back); and OUT/drafter-carry.json: per shard file,
    SHA-256 of the .xz and of the framed bytes, documents, bytes (the framed bytes' SHA-256 is the
    sample's split hash, muser.corpus.split_sha256), the tokenizer's SHA-256, the vocabulary's line-ending
    ids (the bench's line boundary rule, for TrainPrompts' mid-file cuts) and the bench prompts' classes,
    names and lengths."""
    from muser import corpus
    from muser.bench.kinds.ppl import provenance
    from muser.bench.kinds.spec import MID_RULE, ends_line, mid_prompts, start_prompts, synthetic_ids
    from muser.gguf.identity import tokenizer_sha256
    from muser.gguf.reader import read_gguf
    from muser.text import Tokenizer

    docs = corpus.load_docs(root or corpus.DEFAULT_ROOT)
    picks = {"train": corpus.split_docs(docs, "train")[::2], "heldout": corpus.split_docs(docs, "heldout")}
    f = read_gguf(target)
    try:
        tok, tok_sha, prov = Tokenizer.from_gguf(f), tokenizer_sha256(f), provenance(f)
    finally:
        f.close()
    if corpus.split_sha256(picks["heldout"]) != prov["corpus"]["heldout"]["sha256"]:
        raise SystemExit(f"the held-out split under {root or corpus.DEFAULT_ROOT} is not the one {target} records")
    out.mkdir(parents=True, exist_ok=True)
    man: dict = {"rule": "muser.corpus stdlib splits: train = the train split's files at even indices in corpus "
                         "order; heldout = the whole held-out split", "root": str(root or corpus.DEFAULT_ROOT),
                 "shards": {}}
    for split, ds in picks.items():
        blob = b"".join(corpus.frame(d.relpath, d.data) for d in ds)
        xz = lzma.compress(blob, preset=6)
        fn = f"{split}.xz"
        (out / fn).write_bytes(xz)
        man["shards"][split] = {"file": fn, "xz_sha256": hashlib.sha256(xz).hexdigest(),
                                "sha256": hashlib.sha256(blob).hexdigest(), "docs": len(ds),
                                "bytes": sum(len(d.data) for d in ds), "tokens": None}
    nat = start_prompts(tok, picks["heldout"], None, BENCH_PROMPT_TOKENS)
    mid, cuts = mid_prompts(tok, picks["heldout"], [name for name, _ in nat], BENCH_PROMPT_TOKENS)
    rows = ([("natural", n, ids) for n, ids in nat] + [("natural-mid", n, ids) for n, ids in mid]
            + [("synthetic", *synthetic_ids(tok, BENCH_PROMPT_TOKENS))])
    blob = np.concatenate([np.asarray(ids, dtype="<u2") for _, _, ids in rows]).tobytes()
    (out / BENCH_FILE).write_bytes(blob)
    man["tokenizer_sha256"] = tok_sha
    man["line_end_ids"] = [t for t in range(tok.vocab_size) if ends_line(tok, t)]
    man["bench_heldout"] = {"file": BENCH_FILE, "sha256": hashlib.sha256(blob).hexdigest(),
                            "prompt_tokens": BENCH_PROMPT_TOKENS, "mid_rule": MID_RULE,
                            "rule": "muser.bench.kinds.spec start_prompts / mid_prompts / synthetic_ids over the "
                                    "whole held-out split (the bench takes its first --prompts files)",
                            "mid_skipped": sum("skipped" in c for c in cuts),
                            "prompts": [[cls, name, len(ids)] for cls, name, ids in rows]}
    (out / CARRY_MANIFEST).write_text(json.dumps(man, indent=1) + "\n")
    return man


def read_bench_prompts(carry: Path, man: dict) -> list[tuple[str, str, list[int]]]:
    """The carry's held-out bench-class prompts (class, name, ids), the file's SHA-256 checked."""
    info = man["bench_heldout"]
    raw = (carry / info["file"]).read_bytes()
    if hashlib.sha256(raw).hexdigest() != info["sha256"]:
        raise SystemExit(f"{carry / info['file']}: sha256 differs from {CARRY_MANIFEST}")
    ids = np.frombuffer(raw, dtype="<u2").astype(np.int64)
    ends = np.cumsum([n for _, _, n in info["prompts"]])
    if ends[-1] != ids.size:
        raise SystemExit(f"{carry / info['file']}: {ids.size} ids, {CARRY_MANIFEST} lists {int(ends[-1])}")
    return [(cls, name, ids[e - n:e].tolist()) for (cls, name, n), e in zip(info["prompts"], ends)]


def load_target(path: str | Path, dev):
    """The shipped target GGUF in tools/micro_net.py's graph: every tensor dequantized to f32 with muser's
    readers (muser.gguf, muser.quant), geometry from its metadata; the constant QK-norm tensors checked
    and folded into q_scale. Returns (model on dev, geometry, facts: ids, tokens, merges, identity)."""
    import torch

    import micro_net as mn
    from muser.gguf.identity import identity_of
    from muser.gguf.reader import read_gguf
    from muser.quant import dequantize_tensor

    f = read_gguf(path)
    try:
        a = f.get("general.architecture")
        if a != "muse-glimmer":
            raise SystemExit(f"{path}: architecture {a!r}, want 'muse-glimmer'")
        k = lambda s: f.get(f"muse-glimmer.{s}")  # noqa: E731
        tokens = list(f.get("tokenizer.ggml.tokens"))
        g = mn.Geometry(vocab=len(tokens), hidden=k("embedding_length"), n_layers=k("block_count"),
                        n_heads=k("attention.head_count"), n_kv_heads=k("attention.head_count_kv"),
                        head_dim=k("attention.key_length"), ffn=k("feed_forward_length"),
                        window=k("attention.sliding_window"), seq_len=k("context_length"),
                        rms_eps=float(k("attention.layer_norm_rms_epsilon")), logit_scale=float(k("logit_scale")),
                        softcap=float(k("final_logit_softcapping")), rope_base=float(k("rope.freq_base")),
                        rope_base_swa=float(k("rope.freq_base_swa")))
        pattern = [bool(x) for x in k("attention.sliding_window_pattern")]
        if pattern != [g.is_swa(il) for il in range(g.n_layers)]:
            raise SystemExit(f"{path}: sliding_window_pattern {pattern} is not micro_net's collar")
        state = {t.name: torch.from_numpy(dequantize_tensor(f, t.name)) for t in f}
        qn = torch.stack([state[f"blk.{il}.attn_q_norm.weight"] for il in range(g.n_layers)])
        kn = torch.stack([state[f"blk.{il}.attn_k_norm.weight"] for il in range(g.n_layers)])
        if not (torch.all(qn == qn.flatten()[0]) and torch.all(kn == 1.0)):
            raise SystemExit(f"{path}: attn_q_norm is not one constant or attn_k_norm is not ones")
        g.q_scale = float(qn.flatten()[0])
        ids = {n: int(f.get(f"tokenizer.ggml.{n}_token_id")) for n in ("bos", "eos", "eot", "mask")}
        ident = identity_of(f, (ids["eos"], ids["eot"]), use_cache=False)
        facts = {"ids": ids, "tokens": tokens, "merges": list(f.get("tokenizer.ggml.merges")), "identity": ident}
    finally:
        f.close()
    m = mn.MicroGlimmer(g)
    mn.load_gguf_state(m, state)
    return m.to(dev), g, facts


def distill_device(a: argparse.Namespace) -> int:
    """The drafter-only device run (tools/device_train.sh drafter): target from the GGUF, carried text,
    `distill`, OUT/drafter-weights.npz + OUT/drafter-run.json."""
    import torch

    import corpus as corpus_tool
    import corpus_carry
    from muser.gguf.identity import check_pin

    t0 = time.time()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if a.smoke else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA requested but torch.cuda.is_available() is False")
    run: dict = {"format": "muse-glimmer-micro-dflash/1", "status": "running", "device": dev.type,
                 "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
                 "args": {k: str(v) for k, v in vars(a).items()}, "stages": {}}
    rec_path = str(out / RUN_RECORD)

    def save() -> None:
        run["wall_s"] = round(time.time() - t0, 1)
        write_json(rec_path, run)

    def stage(name: str, t: float) -> None:
        run["stages"][name] = round(time.time() - t, 2)
        print(f"distill-device: {name} done in {run['stages'][name]}s ({a.deadline_s - (time.time() - t0):.0f}s left)",
              flush=True)
        save()

    print(f"distill-device: python {sys.version.split()[0]} torch {torch.__version__} numpy {np.__version__} "
          f"device {dev} cores {os.cpu_count()}", flush=True)
    t = time.time()
    target, geo, facts = load_target(a.target, dev)
    ident = facts["identity"]
    pin = Path(a.target).with_name(Path(a.target).name[: -len(".gguf")] + ".pin.json")
    check_pin(ident, pin)  # the drafter is trained for exactly the shipped target
    run["target"] = {"gguf": Path(a.target).name, "artifact_sha256": ident.artifact_sha256,
                     "tokenizer_sha256": ident.tokenizer_sha256, "pin": pin.name, "geometry": asdict(geo)}
    stage("target", t)

    t = time.time()
    carry = Path(a.carry)
    man = json.loads((carry / CARRY_MANIFEST).read_text())
    tok = corpus_tool.tokenizer_from_vocab(facts["tokens"], facts["merges"])
    streams, data = {}, {"rule": man["rule"], "tokenizer": "the target GGUF's vocabulary and merges "
                         "(tools/corpus.py tokenizer_from_vocab), per document [BOS] + ids + [EOS]", "shards": {}}
    for split in ("train", "heldout"):
        info = man["shards"][split]
        ids = corpus_carry.encode(tok, corpus_carry.read_shard(carry, info))
        streams[split] = torch.from_numpy(ids.astype(np.int64))
        data["shards"][split] = {k: info[k] for k in ("file", "sha256", "docs", "bytes")}
        data["shards"][split].update(tokens=int(ids.size), ids_sha256=hashlib.sha256(ids.tobytes()).hexdigest())
    if man["tokenizer_sha256"] != ident.tokenizer_sha256:
        raise SystemExit(f"{carry}: carried for tokenizer {man['tokenizer_sha256']}, {a.target} has "
                         f"{ident.tokenizer_sha256}")
    bench = read_bench_prompts(carry, man)
    prompts = TrainPrompts(streams["train"], facts["ids"]["bos"], man["line_end_ids"])
    data["bench_heldout"] = {k: man["bench_heldout"][k] for k in ("file", "sha256", "prompt_tokens", "rule")}
    data["bench_heldout"]["prompts"] = {c: sum(r[0] == c for r in bench) for c in ("natural", "natural-mid", "synthetic")}
    data["train_prompts"] = {"rule": TRAIN_PROMPT_RULE, "files": int(prompts.doc_start.numel()),
                             "line_boundaries": int(prompts.cut_end.numel())}
    run["data"] = data
    stage("tokenize", t)

    t = time.time()
    left = a.deadline_s - (time.time() - t0) - 8.0  # saving
    try:
        def progress(r: dict) -> None:
            run["drafter"] = r
            save()

        def trained(arrs: dict) -> None:
            run["weights"] = {"file": WEIGHTS, "sha256": save_weights(out, arrs)}
            save()

        cfg = SMOKE_DISTILL if a.smoke else DistillConfig()
        if a.kd_weight is not None:
            cfg = replace(cfg, kd_weight=a.kd_weight)
        _, rec = distill(target, geo, streams["train"], streams["heldout"], facts["ids"]["mask"], left, cfg=cfg,
                         log=lambda m: print(m, flush=True), extra={"target": run["target"], "data": data},
                         baseline=a.baseline, on_progress=progress, on_trained=trained, prompts=prompts, bench=bench)
        run["drafter"] = rec
    except Exception as e:
        import traceback

        run["drafter_error"] = "".join(traceback.format_exception(e))[-4000:]
        print(run["drafter_error"], flush=True)
    stage("drafter", t)
    run["status"] = "done" if "weights" in run and run.get("drafter", {}).get("status") == "done" else "partial"
    run["stop"] = STOP["why"]
    save()
    print(f"distill-device: {run['status']} in {run['wall_s']}s", flush=True)
    return 0 if run["status"] == "done" else 1


# score (here): the training code's metrics on the bench's prompts and on the evaluation's

def anchor_hits(W: dict, ng, target, layers: list[int], seqs, p: int, n_anchors: int, mask_id: int, K: int,
                chunk: int = 32):
    """seqs [B, T] (T >= p + n_anchors + K - 2) -> bool [B, n_anchors, K - 1]: whether the block at anchor
    p - 1 + i proposes ids[n + 1 + j] in row 1 + j (the context of each block is the whole true prefix)."""
    import torch

    with torch.no_grad():
        ctx = drafter_context(W, ng, target, layers, seqs)
        an = torch.arange(p - 1, p - 1 + n_anchors, device=seqs.device)
        out = []
        for j in range(0, n_anchors, chunk):
            a = an[j:j + chunk][None].expand(seqs.shape[0], -1)
            logits, labels = draft_blocks(W, ng, target, ctx, seqs, a, mask_id, K)
            out.append((logits.argmax(-1) == labels)[:, :, 1:])
        return torch.cat(out, 1)


def round_lengths(accepted, n_new: int, k: int) -> list[int]:
    """The rounds muser.spec.SpecSession commits in a greedy generation of n_new tokens that drafts every
    round (the bench's gate held open), from accepted[i] = the accepted prefix (of k) of the block at
    anchor p + i (the first round drafts after the token the prefill picked). A round accepting a < k is
    committed when its bonus token is decoded, one accepting all k when its k-th draft is; nothing is
    decoded once n_new tokens are out, so a round open then is not counted."""
    out, emitted, i = [], 1, 0
    while emitted < n_new:
        a = int(accepted[i])
        if emitted + a + (a < k) < n_new:
            out.append(a)
        emitted += a + 1
        i += a + 1
    return out


def score(a: argparse.Namespace) -> int:
    """The drafter scored by the training code (tools/micro_net.py target, draft_blocks) on (1) the prompts of
    `muser bench spec` and (2) the first --heldout prompts of each held-out group the distillation evaluated
    (same seed, same draws), two ways each: the evaluation's rule (mean accepted prefix over every anchor of
    the generated part) and the bench's (mean accepted per greedy round, every round drafting)."""
    import torch

    import corpus as corpus_tool
    import corpus_carry
    import muser
    from muser import corpus
    from muser.bench.kinds.spec import natural_mid_prompts, natural_prompts, synthetic_prompt

    torch.set_num_threads(a.threads)
    target, facts, D, ng, W = training_pair(a.target, a.drafter, "cpu")
    K, k, n_new, layers, mask = D["block_size"], a.verify_len, a.max_tokens, list(D["target_layers"]), facts["ids"]["mask"]
    cfg = DistillConfig()

    def measure(p: int, prompts, gen_new: int) -> dict:
        """Greedy continuations of gen_new + K tokens (labels for every anchor up to p - 1 + gen_new)."""
        seqs = target.greedy(prompts, gen_new + K)
        run = anchor_hits(W, ng, target, layers, seqs, p, gen_new + 1, mask, K).int().cumprod(-1)  # [B, A, 15]

        def every_anchor(n: int) -> torch.Tensor:  # the evaluation's anchors for n new tokens: p-1 .. p+n-K
            return run[:, : n - K + 2]

        rounds = [round_lengths(x[1:].tolist(), n_new, k) for x in run[:, :, :k].sum(-1)]
        return {"p": p, "every_anchor": every_anchor, "rounds": rounds, "run": run}

    def summary(rows: list[dict], n: int) -> dict:
        ev = torch.cat([r["every_anchor"](n).reshape(-1, K - 1) for r in rows])
        rl = [x for r in rows for rr in r["rounds"] for x in rr]
        return {"blocks": int(ev.shape[0]), f"every_anchor_accepted_of_{K - 1}": round(float(ev.sum(-1).float().mean()), 3),
                f"every_anchor_accepted_of_{k}": round(float(ev[:, :k].sum(-1).float().mean()), 3),
                "rounds": len(rl), f"per_round_accepted_of_{k}": round(sum(rl) / max(len(rl), 1), 3)}

    rec: dict = {"target": Path(a.target).name, "drafter": Path(a.drafter).name, "verify_len": k,
                 "max_tokens": n_new, "bench": {}, "heldout_eval_prompts": {}}
    model = muser.load(a.target, device="cpu")
    try:
        nat = natural_prompts(model, a.prompts, a.prompt_tokens, a.corpus_root)
        mid, _ = natural_mid_prompts(model, [name for name, _ in nat], a.prompt_tokens, a.corpus_root)
        classes = {"natural": nat, "natural-mid": mid, "synthetic": [synthetic_prompt(model, a.prompt_tokens)]}
    finally:
        model.close()
    for cls, prompts in classes.items():
        rows = []
        for name, ids in prompts:
            r = measure(len(ids), torch.tensor([ids]), n_new)
            rows.append(r)
            print(f"bench {cls:11} {name[:30]:30} every anchor {summary([r], n_new)[f'every_anchor_accepted_of_{k}']:.2f} "
                  f"of {k}, per round {summary([r], n_new)[f'per_round_accepted_of_{k}']:.2f} of {k}", flush=True)
        rec["bench"][cls] = {"prompts": [name for name, _ in prompts], **summary(rows, n_new)}
        print(f"bench {cls:11} " + json.dumps(rec["bench"][cls]), flush=True)

    tok = corpus_tool.tokenizer_from_vocab(facts["tokens"], facts["merges"])
    docs = corpus.split_docs(corpus.load_docs(Path(a.corpus_root) if a.corpus_root else corpus.DEFAULT_ROOT), "heldout")
    ids = corpus_carry.encode(tok, [(d.relpath, d.data) for d in docs])
    stream = torch.from_numpy(ids.astype(np.int64))
    gen = torch.Generator().manual_seed(1234)  # distill's generator: the held-out groups are its first draws
    rows = []
    for _ in range(cfg.held_groups):
        p, prompts = draw_prompts(stream, cfg, cfg.held_batch, gen)
        rows.append(measure(p, prompts[: a.heldout], cfg.gen_new))
    h = rec["heldout_eval_prompts"]
    h["ids_sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    h["prompt_lengths"] = [r["p"] for r in rows]
    h[f"gen_new_{cfg.gen_new}"] = summary(rows, cfg.gen_new)
    h[f"first_{n_new}"] = summary(rows, n_new)
    run = torch.cat([r["every_anchor"](cfg.gen_new) for r in rows])  # [B, A, 15]
    h["every_anchor_by_offset"] = [{"offsets": [lo, lo + 15], f"accepted_of_{k}": round(float(
        run[:, lo:lo + 16, :k].sum(-1).float().mean()), 3)} for lo in range(0, run.shape[1], 16)]
    for key in (f"gen_new_{cfg.gen_new}", f"first_{n_new}"):
        print(f"heldout {key:12} " + json.dumps(h[key]), flush=True)
    print("heldout every anchor by offset into the generation: " + ", ".join(
        f"{b['offsets'][0]}-{b['offsets'][1]}: {b[f'accepted_of_{k}']:.2f}" for b in h["every_anchor_by_offset"]))
    if a.out:
        write_json(a.out, rec)
    return 0


# export (here)

def export(weights: Path, target: Path, out: Path) -> int:
    from muser.gguf.identity import identity_of, write_pin
    from muser.gguf.reader import read_gguf
    from muser.spec.format import write_drafter

    if (weights / RUN_RECORD).is_file():  # the drafter-only device run
        run = json.loads((weights / RUN_RECORD).read_text())
    else:  # a whole training run (tools/device_train.py): the drafter of its freshly trained master
        run = json.loads((weights / "micro-run.json").read_text())
    rec = run.get("drafter")
    if not rec or rec.get("status") != "done":
        raise SystemExit(f"{weights} holds no finished drafter record")
    npz = weights / WEIGHTS
    want = run.get("weights", {}).get("sha256") if "file" in run.get("weights", {}) else None
    if want is not None and hashlib.sha256(npz.read_bytes()).hexdigest() != want:
        raise SystemExit(f"{npz}: sha256 differs from the run record's {want}")
    arrs = dict(np.load(npz))
    # what the drafter was trained against: the pinned target GGUF, or the master's weight shards
    trained_on = rec["target"] if "target" in rec else {"weights": run["weights"]["shards"]}
    data = rec["data"] if "data" in rec else run["corpus"]["streams"]
    f = read_gguf(target)
    try:
        have = identity_of(f, ()).artifact_sha256
        if "artifact_sha256" in trained_on and trained_on["artifact_sha256"] != have:
            raise SystemExit(f"{target}: artifact sha256 {have}, the drafter was trained for "
                             f"{trained_on['artifact_sha256']} ({trained_on.get('gguf')})")
        tg = {k: f.get(k) for k in f.fields if k.startswith("muse-glimmer.")}
        geo = dict(rec["draft"], hidden=tg["muse-glimmer.embedding_length"],
                   context_length=tg["muse-glimmer.context_length"], name="muse-glimmer-micro-dflash",
                   provenance=json.dumps({"target": trained_on, "data": data, "steps": rec["steps"],
                                          "eval": rec["eval"], "train_s": rec["train_s"]}, sort_keys=True))
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
    c = sub.add_parser("carry", help="write the text the drafter-only device run reads")
    c.add_argument("--out", type=Path, default=CARRY)
    c.add_argument("--root", type=Path, default=None, help="the CPython 3.11.7 stdlib (muser.corpus.DEFAULT_ROOT)")
    d = sub.add_parser("distill-device", help="the drafter-only device run (tools/device_train.sh drafter)")
    d.add_argument("--target", required=True, help="the target GGUF; its .pin.json beside it is checked")
    d.add_argument("--carry", default=str(CARRY), help="the folder `carry` wrote")
    d.add_argument("--out", required=True)
    d.add_argument("--deadline-s", type=float, default=380.0, help="wall seconds from start for everything")
    d.add_argument("--baseline", default=None, help="a drafter GGUF evaluated on the same held-out continuations")
    d.add_argument("--smoke", action="store_true", help="the CPU, tiny sizes, a minute")
    d.add_argument("--kd-weight", type=float, default=None,
                   help="weight of the T=0.7 distillation term (default DistillConfig's; 0: greedy CE only)")
    sc = sub.add_parser("score", help="the training code's acceptance on the bench's prompts and the evaluation's")
    sc.add_argument("--target", default=str(REPO / "models" / "muse-glimmer-micro-q8_0.gguf"))
    sc.add_argument("--drafter", default=str(REPO / "models" / "muse-glimmer-micro-dflash.gguf"))
    sc.add_argument("--verify-len", type=int, default=7, choices=(3, 7, 15))
    sc.add_argument("--prompts", type=int, default=3, help="held-out files of the bench (muser bench spec --prompts)")
    sc.add_argument("--prompt-tokens", type=int, default=256)
    sc.add_argument("--max-tokens", type=int, default=64, help="generated tokens the rounds cover (the bench's)")
    sc.add_argument("--heldout", type=int, default=8, help="evaluation prompts kept per held-out group")
    sc.add_argument("--corpus-root", default=None)
    sc.add_argument("--threads", type=int, default=2)
    sc.add_argument("--out", default=None, help="the record as JSON")
    a = ap.parse_args(argv)
    if a.cmd == "score":
        return score(a)
    if a.cmd == "carry":
        man = write_carry(a.out, a.root)
        for split, info in man["shards"].items():
            print(f"{a.out / info['file']}: {info['docs']} files, {info['bytes']:,} bytes, "
                  f"{(a.out / info['file']).stat().st_size:,} B xz")
        return 0
    if a.cmd == "distill-device":
        return distill_device(a)
    return export(a.weights, a.target, a.out)


if __name__ == "__main__":
    sys.exit(main())
