"""The micro Muse Glimmer in torch, in the convention llama.cpp computes (the trainer's model).

Self-contained (torch only: the GPU machine has no gguf and no muser install); tools/train_micro.py
trains it, tools/train_drafter.py distills a DFlash drafter from it, tests/micro check it against the
pinned llama.cpp on exported GGUFs.

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

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

COLLAR = 4  # [S, S, S, F]: layer il is full iff il % 4 == 3 (muse-glimmer.cpp load_swa_pattern(ml, 4))


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

    def layer_matmul_params(self) -> int:
        # q, gate [attn, h]; k, v [kv, h]; o [h, attn]; gate/up [ffn, h]; down [h, ffn]
        return 3 * self.attn_dim * self.hidden + 2 * self.kv_dim * self.hidden + 3 * self.ffn * self.hidden

    def n_params(self) -> int:
        """Trained parameters (the QK-norm constants are not trained)."""
        return (2 * self.vocab * self.hidden + self.hidden
                + self.n_layers * (self.layer_matmul_params() + 4 * self.hidden))

    def train_flops_per_token(self) -> float:
        """Forward + backward FLOPs per trained token at seq_len: 6 per matmul weight (the embedding is a
        lookup, the LM head a matmul) plus attention's QK^T and AV, 3 x 2 x 2 x attn_dim per visible key."""
        T = self.seq_len
        full = (T + 1) / 2  # mean causal keys per query
        swa = sum(min(i + 1, self.window) for i in range(T)) / T
        keys = sum(swa if self.is_swa(il) else full for il in range(self.n_layers))
        return 6.0 * (self.n_layers * self.layer_matmul_params() + self.vocab * self.hidden) + 12.0 * self.attn_dim * keys


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

    def _project(self, x: torch.Tensor, cos, sin):
        """x [B, T, h] -> q [B, T, H, hd], k, v [B, T, H_kv, hd] (normed, roped on sliding layers), gate [B, T, a]."""
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
        return q, k, v, gate

    def _finish(self, x: torch.Tensor, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [B, T, a] (head-major attention output) -> the block's output residual [B, T, h]."""
        g = self.g
        o = o * torch.sigmoid(gate).to(o.dtype)  # gate before o_proj
        o = F.linear(o, self.attn_output)
        x = x + rms(o, g.post_norm_eps) * self.post_attention_norm
        fn = rms(x, g.rms_eps) * self.ffn_norm
        f = F.linear(F.silu(F.linear(fn, self.ffn_gate)) * F.linear(fn, self.ffn_up), self.ffn_down)
        return x + rms(f, g.post_norm_eps) * self.post_ffw_norm

    def forward(self, x: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        g = self.g
        B, T, _ = x.shape
        q, k, v, gate = self._project(x, cos, sin)
        dt = v.dtype  # bf16 under autocast, f32 otherwise
        q, k, v = (t.to(dt).transpose(1, 2) for t in (q, k, v))  # [B, H*, T, hd]
        rep = g.n_heads // g.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # q head i -> kv head i // rep
        scale = 1.0 / math.sqrt(g.head_dim)
        if self.swa:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:T, :T], scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self._finish(x, o.transpose(1, 2).reshape(B, T, g.attn_dim), gate)  # head-major, like ggml's [hd*H, T]

    def forward_cached(self, x: torch.Tensor, p0: int, K: torch.Tensor, V: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [B, T, h] at positions p0..p0+T-1; K, V [B, H_kv, L, hd] this layer's cache, filled below p0.
        Writes the chunk's keys and values at p0..p0+T-1, then attends over positions 0..p0+T-1 (causal,
        and the window on sliding layers): the same function as forward, one chunk at a time (f32)."""
        g = self.g
        B, T, _ = x.shape
        q, k, v, gate = self._project(x, cos[p0:], sin[p0:])
        n = p0 + T
        K[:, :, p0:n], V[:, :, p0:n] = k.transpose(1, 2), v.transpose(1, 2)
        rep = g.n_heads // g.n_kv_heads
        # q head i reads kv head i // rep: fold the rep heads of a KV group into the query rows, no K/V copy
        qg = q.transpose(1, 2).reshape(B, g.n_kv_heads, rep * T, g.head_dim)  # row r*T + t = head kv*rep+r, t
        i = torch.arange(p0, n, device=x.device)[:, None]
        j = torch.arange(n, device=x.device)[None, :]
        vis = (j <= i) & (i - j < g.window) if self.swa else (j <= i)  # [T, n]
        o = F.scaled_dot_product_attention(qg, K[:, :, :n], V[:, :, :n], attn_mask=vis.repeat(rep, 1),
                                           scale=1.0 / math.sqrt(g.head_dim))  # [B, H_kv, rep*T, hd]
        o = o.reshape(B, g.n_heads, T, g.head_dim).transpose(1, 2).reshape(B, T, g.attn_dim)
        return self._finish(x, o, gate)


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

    @torch.no_grad()
    def greedy(self, prompt: torch.Tensor, n_new: int) -> torch.Tensor:
        """prompt [B, p] int64 -> [B, p + n_new]: the greedy continuation, KV-cached (one prefill of the
        prompt, then one position per step). The argmax is taken before logit scale and softcap (both
        monotone), so a tie the f32 tanh would create cannot change it."""
        g = self.g
        B, p = prompt.shape
        L = p + n_new
        if L > g.seq_len:
            raise ValueError(f"prompt {p} + {n_new} new tokens exceeds the context {g.seq_len}")
        kv = [(torch.empty(B, g.n_kv_heads, L, g.head_dim, device=prompt.device, dtype=self.output.dtype),
               torch.empty(B, g.n_kv_heads, L, g.head_dim, device=prompt.device, dtype=self.output.dtype))
              for _ in self.blocks]
        out = torch.empty(B, L, dtype=torch.long, device=prompt.device)
        out[:, :p] = prompt
        ids, p0 = prompt, 0
        for _ in range(n_new):
            x = rms(F.embedding(ids, self.token_embd), g.rms_eps)
            for b, (K, V) in zip(self.blocks, kv):
                x = b.forward_cached(x, p0, K, V, self.cos, self.sin)
            last = rms(x[:, -1], g.rms_eps) * self.output_norm  # [B, h]
            p0 += ids.shape[1]
            out[:, p0] = F.linear(last, self.output).argmax(-1)
            ids = out[:, p0:p0 + 1]
        return out

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
