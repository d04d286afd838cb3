#!/usr/bin/env python3
"""Train the micro Muse Glimmer (torch; one GPU, time-boxed) in the convention llama.cpp computes.

    python3 tools/train_micro.py --data .device/micro --out OUT [--budget-s 460]
    python3 tools/train_micro.py --data .device/micro --out /tmp/smoke --smoke      # CPU, tiny, seconds

Self-contained (torch + numpy only: the GPU machine has no gguf and no muser install). It reads the
uint16 token streams written by tools/corpus.py, trains until the wall-clock budget is spent, keeps the
checkpoint with the best val loss, measures the held-out loss, and writes into OUT:
    micro-weights-N.npz   float32 tensors under their GGUF names, numpy order [out, in], <= 15 MiB each
    micro-weights.json    geometry, tensor -> shard map, shard SHA-256s, provenance
    micro-train-log.json  the loss curve and the final losses (rewritten after every evaluation)
so tools/export_micro.py turns them into GGUF by a straight copy.

The graph is src/models/muse-glimmer.cpp of the pinned llama.cpp, term for term:
  x = rms(embd, 1e-5)                                     weightless entry norm
  per layer: h = rms(x, 1e-5) * attn_norm                 weights stored as llama.cpp multiplies them
             q, k, v, g = h Wq, h Wk, h Wv, h Wgate
             q = rms_head(q, 1e-5) * q_scale; k = rms_head(k, 1e-5)   weightless QK-norm, constant q scale
             sliding layers: interleaved (NORM) RoPE on q, k with rope.freq_base_swa; full layers: NoPE
             a = softmax(q k^T / sqrt(head_dim), causal [and window W: 0 <= i - j < W]) v   (GQA)
             a = a * sigmoid(g); o = a Wo; x = x + rms(o, 1e-8) * post_attention_norm
             f = rms(x, 1e-5) * ffn_norm; f = (silu(f Wgate) * f Wup) Wdown
             x = x + rms(f, 1e-8) * post_ffw_norm
  logits = softcap * tanh((rms(x, 1e-5) * output_norm) Wout * logit_scale / softcap)
Q/K rows are laid out for the interleaved rotation (pairs (2i, 2i+1) of each head), which is the layout
the GGUF stores, so no un-permutation is needed at export.
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
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

COLLAR = 4  # [S, S, S, F]: layer il is full iff il % 4 == 3 (muse-glimmer.cpp load_swa_pattern(ml, 4))
SHARD_LIMIT = 15 << 20  # bytes per weight shard (the device returns files <= 16 MiB)


@dataclass
class Geometry:
    vocab: int
    hidden: int = 256
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 64  # != hidden / n_heads (= 32): attn_dim 512
    ffn: int = 768
    window: int = 256
    seq_len: int = 1024  # training context; written as context_length
    rms_eps: float = 1e-5
    post_norm_eps: float = 1e-8  # muse-glimmer.cpp: const float post_norm_eps = 1e-8f
    q_scale: float = 3.87  # qk_scale_factor, broadcast into attn_q_norm (book 9.9)
    logit_scale: float = 1.0 / math.sqrt(26.0)
    softcap: float = 20.0
    rope_base: float = 1_000_000.0  # rope.freq_base: unused by the NoPE full layers
    rope_base_swa: float = 10_000.0  # rope.freq_base_swa: the sliding layers' theta

    def check(self) -> None:
        if self.n_layers % COLLAR:
            raise SystemExit(f"n_layers {self.n_layers} is not a multiple of the collar {COLLAR}")
        if self.n_heads % self.n_kv_heads:
            raise SystemExit(f"n_heads {self.n_heads} not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise SystemExit(f"head_dim {self.head_dim} must be even")
        if self.head_dim * self.n_heads == self.hidden:
            raise SystemExit("head_dim must differ from hidden / n_heads (a Muse Glimmer trap kept on purpose)")

    @property
    def attn_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_swa(self, il: int) -> bool:
        return il % COLLAR != COLLAR - 1


SMOKE = dict(hidden=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=32, ffn=128, window=16, seq_len=64)


# ---------------------------------------------------------------------------------------------
# model


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # ggml_rms_norm: x / sqrt(mean(x^2) + eps), over the last dim; computed in f32
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rope_tables(g: Geometry, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # ggml_rope NORM mode: pair i of a head rotates by p * base^(-2i / head_dim)
    inv = g.rope_base_swa ** (-torch.arange(0, g.head_dim, 2, dtype=torch.float64) / g.head_dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]  # [n, hd/2]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd] f32; rotates adjacent pairs (x[2i], x[2i+1]) (ggml rope_f32, mode 0)."""
    B, T, H, D = x.shape
    x2 = x.view(B, T, H, D // 2, 2)
    x0, x1 = x2[..., 0], x2[..., 1]
    c, s = cos[:T].view(1, T, 1, D // 2), sin[:T].view(1, T, 1, D // 2)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).view(B, T, H, D)


def window_mask(n: int, w: int, device) -> torch.Tensor:
    # llama_hparams::is_masked_swa (STANDARD): key j is visible to query i iff 0 <= i - j < W
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (i - j >= 0) & (i - j < w)  # [n, n] bool, True = attend


class Block(nn.Module):
    def __init__(self, g: Geometry, il: int):
        super().__init__()
        self.g, self.il, self.swa = g, il, g.is_swa(il)
        self.use_rope = self.swa  # muse-glimmer.cpp: `const bool use_rope = hparams.is_swa(il);`
        h, a, kv, ff = g.hidden, g.attn_dim, g.kv_dim, g.ffn
        P = lambda *s: nn.Parameter(torch.empty(*s))  # noqa: E731
        self.attn_norm, self.post_attention_norm = P(h), P(h)
        self.ffn_norm, self.post_ffw_norm = P(h), P(h)
        self.attn_q, self.attn_k, self.attn_v, self.attn_gate = P(a, h), P(kv, h), P(kv, h), P(a, h)
        self.attn_output = P(h, a)
        self.ffn_gate, self.ffn_up, self.ffn_down = P(ff, h), P(ff, h), P(h, ff)

    def reset(self, gen: torch.Generator) -> None:
        with torch.no_grad():
            for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
                getattr(self, n).fill_(1.0)
            for n in ("attn_q", "attn_k", "attn_v", "attn_gate", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
                w = getattr(self, n)
                w.copy_(torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[1]))

    def forward(self, x: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        g = self.g
        B, T, _ = x.shape
        hn = rms(x, g.rms_eps) * self.attn_norm  # [B, T, h] f32
        q = F.linear(hn, self.attn_q).view(B, T, g.n_heads, g.head_dim)
        k = F.linear(hn, self.attn_k).view(B, T, g.n_kv_heads, g.head_dim)
        v = F.linear(hn, self.attn_v).view(B, T, g.n_kv_heads, g.head_dim)
        gate = F.linear(hn, self.attn_gate)  # [B, T, a]
        q = rms(q, g.rms_eps) * g.q_scale  # weightless per-head norm, then the qk_scale_factor
        k = rms(k, g.rms_eps)  # k scale 1
        if self.use_rope:
            q, k = rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)
        dt = v.dtype  # bf16 under autocast, f32 otherwise
        q, k, v = (t.to(dt).transpose(1, 2) for t in (q, k, v))  # [B, H*, T, hd]
        rep = g.n_heads // g.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # q head i -> kv head i // rep
        scale = 1.0 / math.sqrt(g.head_dim)
        if self.swa:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:T, :T], scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        o = o.transpose(1, 2).reshape(B, T, g.attn_dim)  # head-major, like ggml's [hd*H, T]
        o = o * torch.sigmoid(gate).to(o.dtype)  # gate before o_proj
        o = F.linear(o, self.attn_output)
        x = x + rms(o, g.post_norm_eps) * self.post_attention_norm
        fn = rms(x, g.rms_eps) * self.ffn_norm
        f = F.linear(F.silu(F.linear(fn, self.ffn_gate)) * F.linear(fn, self.ffn_up), self.ffn_down)
        return x + rms(f, g.post_norm_eps) * self.post_ffw_norm


class MicroGlimmer(nn.Module):
    def __init__(self, g: Geometry, device="cpu"):
        super().__init__()
        g.check()
        self.g = g
        self.token_embd = nn.Parameter(torch.empty(g.vocab, g.hidden))
        self.blocks = nn.ModuleList(Block(g, il) for il in range(g.n_layers))
        self.output_norm = nn.Parameter(torch.empty(g.hidden))
        self.output = nn.Parameter(torch.empty(g.vocab, g.hidden))  # untied LM head
        cos, sin = rope_tables(g, g.seq_len, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("mask", window_mask(g.seq_len, g.window, "cpu"), persistent=False)

    def reset(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.token_embd.copy_(torch.randn(self.token_embd.shape, generator=gen))
            self.output_norm.fill_(1.0)
            self.output.copy_(torch.randn(self.output.shape, generator=gen) / math.sqrt(self.g.hidden))
        for b in self.blocks:
            b.reset(gen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, vocab] f32 (after logit scale and softcap)."""
        g = self.g
        x = rms(F.embedding(ids, self.token_embd), g.rms_eps)  # weightless entry norm
        for b in self.blocks:
            x = b(x, self.cos, self.sin, self.mask)
        x = rms(x, g.rms_eps) * self.output_norm
        logits = F.linear(x, self.output).float() * g.logit_scale
        return g.softcap * torch.tanh(logits / g.softcap)

    def gguf_state(self) -> dict[str, torch.Tensor]:
        """Every tensor under its GGUF name, numpy order; QK-norm constants synthesized (book 9.9)."""
        g = self.g
        out = {"token_embd.weight": self.token_embd, "output_norm.weight": self.output_norm,
               "output.weight": self.output}
        for il, b in enumerate(self.blocks):
            p = f"blk.{il}."
            for n in ("attn_norm", "attn_q", "attn_k", "attn_v"):
                out[p + n + ".weight"] = getattr(b, n)
            out[p + "attn_q_norm.weight"] = torch.full((g.head_dim,), g.q_scale)
            out[p + "attn_k_norm.weight"] = torch.ones(g.head_dim)
            for n in ("attn_gate", "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
                      "ffn_down", "post_ffw_norm"):
                out[p + n + ".weight"] = getattr(b, n)
        return {k: v.detach().float().cpu() for k, v in out.items()}

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


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
    """Non-overlapping windows of L tokens (stride L, partial tail dropped): [n, L]."""
    n = stream.numel() // L
    if limit is not None:
        n = min(n, limit)
    return stream[: n * L].view(n, L).long()


@torch.no_grad()
def mean_nll(model: MicroGlimmer, windows: torch.Tensor, batch: int, amp) -> float:
    """Mean NLL (nats) of tokens 1..L-1 of each window, each window a fresh context from position 0."""
    model.eval()
    tot, cnt = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        with amp():
            logits = model(w)[:, :-1]  # the whole window (T = L, the training shape); last row unused
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        tot += float(nll)
        cnt += w[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1)


# ---------------------------------------------------------------------------------------------
# saving


def _atomic_write(path: str, write) -> None:
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def save_weights(out: str, state: dict[str, torch.Tensor], meta: dict) -> None:
    # first-fit decreasing into shards of <= SHARD_LIMIT bytes (12.6M f32 params -> 4 shards)
    shards: list[list[str]] = []
    sizes: list[int] = []
    for name in sorted(state, key=lambda n: -state[n].numel()):
        nb = state[name].numel() * 4
        for i, sz in enumerate(sizes):
            if sz + nb <= SHARD_LIMIT:
                shards[i].append(name)
                sizes[i] += nb
                break
        else:
            shards.append([name])
            sizes.append(nb)
    index, digests = {}, []
    for i, names in enumerate(shards):
        fn = f"micro-weights-{i}.npz"
        arrays = {n: state[n].numpy().astype("<f4") for n in names}
        _atomic_write(os.path.join(out, fn), lambda f: np.savez(f, **arrays))
        digests.append(hashlib.sha256(open(os.path.join(out, fn), "rb").read()).hexdigest())
        for n in names:
            index[n] = {"shard": fn, "shape": list(state[n].shape)}
    for stale in sorted(os.listdir(out)):  # a previous save with more shards
        if stale.startswith("micro-weights-") and stale.endswith(".npz") and stale not in {
                f"micro-weights-{i}.npz" for i in range(len(shards))}:
            os.unlink(os.path.join(out, stale))
    body = dict(meta, tensors=index, shards={f"micro-weights-{i}.npz": d for i, d in enumerate(digests)})
    _atomic_write(os.path.join(out, "micro-weights.json"), lambda f: f.write(json.dumps(body, indent=1).encode()))


def write_log(out: str, log: dict) -> None:
    _atomic_write(os.path.join(out, "micro-train-log.json"), lambda f: f.write(json.dumps(log, indent=1).encode()))


# ---------------------------------------------------------------------------------------------
# training


def lr_at(step: int, progress: float, a) -> float:
    warm = min(1.0, (step + 1) / a.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return a.lr * warm * (a.min_lr_ratio + (1.0 - a.min_lr_ratio) * cos)


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder written by tools/corpus.py build")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny geometry on the CPU, a few steps")
    ap.add_argument("--device", default=None, help="cuda (default) or cpu (default with --smoke)")
    ap.add_argument("--budget-s", type=float, default=460.0, help="wall seconds from start to the end of training")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    ap.add_argument("--max-epochs", type=float, default=60.0, help="cap on passes over the train stream")
    ap.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every-s", type=float, default=20.0)
    ap.add_argument("--save-every-s", type=float, default=120.0)
    ap.add_argument("--eval-limit", type=int, default=None, help="evaluate at most this many windows per split")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (compile time counts)")
    ap.add_argument("--amp", choices=["bf16", "none"], default=None,
                    help="autocast dtype (default: bf16 on cuda, none on cpu)")
    for f in ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn", "window", "seq_len"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=None)
    a = ap.parse_args(argv)

    os.makedirs(a.out, exist_ok=True)
    dev = a.device or ("cpu" if a.smoke else "cuda")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("CUDA requested but torch.cuda.is_available() is False")
    manifest = json.load(open(os.path.join(a.data, "corpus.json")))
    geo_kw = dict(SMOKE) if a.smoke else {}
    for f in ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn", "window", "seq_len"):
        if getattr(a, f) is not None:
            geo_kw[f] = getattr(a, f)
    g = Geometry(vocab=int(manifest["tokenizer"]["vocab_size"]), **geo_kw)
    g.check()
    if a.smoke:
        a.batch = min(a.batch, 8)
        a.max_steps = a.max_steps or 12
        a.warmup_steps = min(a.warmup_steps, 4)
        a.eval_every_s = 0.0

    torch.manual_seed(a.seed)
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    train = load_stream(a.data, "train", manifest, dev)
    val = load_stream(a.data, "val", manifest, dev)
    held = load_stream(a.data, "heldout", manifest, dev)
    for name, s in (("train", train), ("val", val), ("heldout", held)):
        if int(s.max()) >= g.vocab:
            raise SystemExit(f"{name} stream holds token {int(s.max())} >= vocab {g.vocab}")
    L = g.seq_len
    limit = a.eval_limit if a.eval_limit is not None else (8 if a.smoke else None)
    val_w = eval_windows(val, L, limit)
    held_w = eval_windows(held, L, limit)

    model = MicroGlimmer(g)
    model.reset(a.seed)
    model.to(dev)
    fwd = torch.compile(model) if a.compile else model
    on_cuda = dev.startswith("cuda")
    amp_mode = a.amp or ("bf16" if on_cuda else "none")
    dev_type = "cuda" if on_cuda else "cpu"

    def amp():
        if on_cuda:  # flash (causal) / memory-efficient (window mask) kernels; cuDNN attention left out
            from contextlib import ExitStack
            from torch.nn.attention import SDPBackend, sdpa_kernel

            st = ExitStack()
            st.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                          SDPBackend.MATH]))
            st.enter_context(torch.autocast(dev_type, dtype=torch.bfloat16, enabled=amp_mode == "bf16"))
            return st
        return torch.autocast(dev_type, dtype=torch.bfloat16, enabled=amp_mode == "bf16")

    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]  # norm weights: no decay toward 0
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if on_cuda else {}),
    )
    gen = torch.Generator(device=dev).manual_seed(a.seed)
    ar = torch.arange(L + 1, device=dev)

    log = {
        "geometry": asdict(g), "n_params": model.n_params(), "args": vars(a), "device": dev,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if on_cuda else None,
        "corpus": {"splits": manifest["splits"], "streams": manifest["streams"],
                   "tokenizer_vocab_sha256": manifest["tokenizer"]["vocab_sha256"]},
        "amp": amp_mode, "curve": [], "status": "running",
    }
    print(f"micro: {model.n_params():,} params, geometry {asdict(g)}", flush=True)
    print(f"micro: train {train.numel():,} tokens, val {val_w.numel():,}, heldout {held_w.numel():,}; "
          f"setup {time.time() - t_start:.1f}s", flush=True)

    stop = {"why": None}

    def on_signal(signum, frame):
        stop["why"] = f"signal {signum}"

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    micro = a.batch
    accum = 1
    step, tokens = 0, 0
    best = {"val": float("inf"), "state": None, "step": -1}
    last_eval = last_save = time.time()
    t_train = time.time()
    run_loss, run_n = torch.zeros((), device=dev), 0
    max_tokens = a.max_epochs * train.numel()

    def snapshot(val_loss: float) -> None:
        if val_loss < best["val"]:
            best.update(val=val_loss, step=step, state=model.gguf_state())

    def evaluate() -> float:
        v = mean_nll(fwd, val_w, 64 if not a.smoke else 8, amp)
        snapshot(v)
        return v

    def save(status: str) -> None:
        if best["state"] is None:
            return
        meta = {"format": "muse-glimmer-micro/1", "geometry": asdict(g), "step": best["step"],
                "val_loss": best["val"], "selected": "best val loss", "status": status,
                "tokenizer_vocab_sha256": manifest["tokenizer"]["vocab_sha256"],
                "streams": {k: v["sha256"] for k, v in manifest["streams"].items()}}
        save_weights(a.out, best["state"], meta)

    try:
        while True:
            elapsed = time.time() - t_start
            progress = max(elapsed / a.budget_s, tokens / max_tokens)
            if a.max_steps:
                progress = max(progress, step / a.max_steps)
            if progress >= 1.0 or stop["why"]:
                break
            lr = lr_at(step, progress, a)
            for grp in opt.param_groups:
                grp["lr"] = lr
            try:
                for _ in range(accum):
                    off = torch.randint(0, train.numel() - L - 1, (micro,), device=dev, generator=gen)
                    chunk = train[off[:, None] + ar[None, :]].long()  # [micro, L + 1]
                    with amp():
                        logits = fwd(chunk[:, :-1])
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
                print(f"micro: out of memory at the first step; micro-batch {micro} x {accum}", flush=True)
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += a.batch * L
            if step == 1:
                log["first_step_s"] = round(time.time() - t_start, 2)
            now = time.time()
            if step % 50 == 0 or a.smoke or now - last_eval >= a.eval_every_s:
                tl = float(run_loss) / max(run_n, 1)
                run_loss.zero_()
                run_n = 0
                if not math.isfinite(tl):
                    stop["why"] = f"non-finite train loss {tl} at step {step}"
                    break
                rec = {"step": step, "tokens": tokens, "epochs": round(tokens / train.numel(), 3),
                       "elapsed_s": round(now - t_start, 1), "lr": lr, "train_loss": round(tl, 5)}
                if now - last_eval >= a.eval_every_s:
                    rec["val_loss"] = round(evaluate(), 5)
                    last_eval = time.time()
                    rec["tok_per_s"] = round(tokens / (last_eval - t_train))
                    print(f"step {step:6d} ep {rec['epochs']:6.2f} lr {lr:.2e} train {tl:.4f} "
                          f"val {rec['val_loss']:.4f} {rec['tok_per_s']:,} tok/s t={rec['elapsed_s']}s", flush=True)
                    write_log(a.out, log)
                log["curve"].append(rec)
            if time.time() - last_save >= a.save_every_s:
                save("partial")
                last_save = time.time()
    except Exception as e:  # keep what was learned; the device run is not repeatable cheaply
        log["error"] = "".join(traceback.format_exception(e))[-4000:]
        print(log["error"], flush=True)

    # final: evaluate the last state, keep the best by val, measure held-out for both
    t_end = time.time()
    log.update(steps=step, tokens=tokens, epochs=round(tokens / train.numel(), 3), stop=stop["why"] or "budget",
               train_s=round(t_end - t_train, 1), micro_batch=micro, accum=accum)
    if step > 0 and "error" not in log:
        try:
            final_val = mean_nll(fwd, val_w, 64 if not a.smoke else 8, amp)
            final_held = mean_nll(fwd, held_w, 64 if not a.smoke else 8, amp)
            log["final"] = {"step": step, "val_loss": final_val, "heldout_loss": final_held}
            snapshot(final_val)  # NaN never wins: a diverged run keeps its best earlier state
            if best["state"] is not None and best["step"] != step:
                load_gguf_state(model, best["state"])
                log["best"] = {"step": best["step"], "val_loss": best["val"],
                               "heldout_loss": mean_nll(fwd, held_w, 64 if not a.smoke else 8, amp)}
            elif best["step"] == step:
                log["best"] = dict(log["final"])
        except Exception as e:
            log["error"] = "".join(traceback.format_exception(e))[-4000:]
            print(log["error"], flush=True)
    if best["state"] is None and "error" not in log:
        log["error"] = f"no checkpoint with a finite val loss to save (stop: {log['stop']})"
    if on_cuda:
        log["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    save("final" if "error" not in log else "error")
    log["status"] = "error" if "error" in log else "done"
    log["wall_s"] = round(time.time() - t_start, 1)
    write_log(a.out, log)
    b = log.get("best", {})
    print(f"micro: {log['status']} after {step} steps, {tokens:,} tokens ({log['epochs']} epochs) in "
          f"{log['wall_s']}s; best step {b.get('step')} val {b.get('val_loss')} heldout {b.get('heldout_loss')}",
          flush=True)
    return 0 if log["status"] == "done" else 1


def load_gguf_state(model: MicroGlimmer, state: dict[str, torch.Tensor]) -> None:
    """Inverse of gguf_state (QK-norm constants are not parameters)."""
    with torch.no_grad():
        model.token_embd.copy_(state["token_embd.weight"])
        model.output_norm.copy_(state["output_norm.weight"])
        model.output.copy_(state["output.weight"])
        for il, b in enumerate(model.blocks):
            for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_gate", "attn_output",
                      "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"):
                getattr(b, n).copy_(state[f"blk.{il}.{n}.weight"])


if __name__ == "__main__":
    sys.exit(main())
