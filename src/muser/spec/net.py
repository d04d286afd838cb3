"""The DFlash drafter's arithmetic in torch, batched, with no I/O (the runtime and the trainer
share it; src/models/dflash.cpp of the pinned llama.cpp, `graph<false>`, DFlash1 path):

  context injection (embd batch):  g = rms(feat fc^T) * enc.output_norm          feat [.., n_cap * H]
                                   per layer: K = rope(rms_head(g Wk) * k_norm), V = g Wv
  block (token batch):             x = embd[tokens] (* embedding_scale)
                                   per layer: h = rms(x) * attn_norm
                                              q, k, v = h Wq, h Wk, h Wv; q, k = rms_head(.) * q/k_norm
                                              q, k = rope_neox(q, k, position)
                                              a = softmax(q [K_ctx; k]^T * scale) [V_ctx; v]   non-causal
                                              x = x + (a Wo) (* value_scale)
                                              x = x + down(silu(gate(f)) * up(f)), f = rms(x) * ffn_norm
                                   out = rms(x) * output_norm; logits = out head^T
RMS norms are ggml_rms_norm (x / sqrt(mean x^2 + eps)); RoPE is ggml's NEOX mode (pairs i, i + n_rot/2),
which llama_model_rope_type gives the `dflash` architecture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class NetGeometry:
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    n_capture: int
    n_rot: int
    rope_base: float
    eps: float
    attn_scale: float  # dflash.attention.scale, else 1/sqrt(head_dim)
    embedding_scale: float  # 0 = none (llama.cpp: applied only when != 0)
    value_scale: float  # 0 = none


LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
GLOBAL_TENSORS = ("fc", "enc.output_norm", "output_norm")


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rope_neox(x: torch.Tensor, pos: torch.Tensor, g: NetGeometry) -> torch.Tensor:
    """x [..., T, heads, hd], pos [..., T] int64: ggml rope NEOX over the first n_rot dims."""
    half = g.n_rot // 2
    inv = g.rope_base ** (-torch.arange(0, half, dtype=torch.float64, device=x.device) * 2.0 / g.n_rot)
    ang = (pos.to(torch.float64)[..., None] * inv).to(torch.float32)  # [..., T, half]
    c, s = ang.cos()[..., None, :], ang.sin()[..., None, :]  # [..., T, 1, half]
    x0, x1, rest = x[..., :half], x[..., half:g.n_rot], x[..., g.n_rot:]
    return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c, rest), dim=-1)


def fuse(W: dict, feat: torch.Tensor, g: NetGeometry) -> torch.Tensor:
    """feat [..., T, n_cap*H] -> g [..., T, H]: the fc projection and its norm (the 'encoder')."""
    return rms(F.linear(feat, W["fc"]), g.eps) * W["enc.output_norm"]


def context_kv(W: dict, il: int, fused: torch.Tensor, pos: torch.Tensor,
               g: NetGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Injected K/V of layer il for fused rows [..., T, H] at positions [..., T]:
    K, V [..., T, n_kv, hd] (K normed and roped, V raw)."""
    L = W["layers"][il]
    shp = fused.shape[:-1] + (g.n_kv_heads, g.head_dim)
    k = rms(F.linear(fused, L["attn_k"]).view(shp), g.eps) * L["attn_k_norm"]
    v = F.linear(fused, L["attn_v"]).view(shp)
    return rope_neox(k, pos, g), v


def block_hidden(W: dict, embd: torch.Tensor, pos: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
                 g: NetGeometry, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The noise block through the draft layers.

    embd [N, Tq, H] block token embeddings; pos [N, Tq]; ctx[il] = (K, V) each [N, Tc, n_kv, hd];
    mask [N, Tq, Tc + Tq] bool (True = attend) or None (all visible: the runtime's single block).
    Returns the normed output [N, Tq, H] (before the LM head)."""
    N, Tq, _ = embd.shape
    x = embd * g.embedding_scale if g.embedding_scale != 0.0 else embd
    rep = g.n_heads // g.n_kv_heads
    for il, L in enumerate(W["layers"]):
        h = rms(x, g.eps) * L["attn_norm"]
        q = rms(F.linear(h, L["attn_q"]).view(N, Tq, g.n_heads, g.head_dim), g.eps) * L["attn_q_norm"]
        k = rms(F.linear(h, L["attn_k"]).view(N, Tq, g.n_kv_heads, g.head_dim), g.eps) * L["attn_k_norm"]
        v = F.linear(h, L["attn_v"]).view(N, Tq, g.n_kv_heads, g.head_dim)
        q, k = rope_neox(q, pos, g), rope_neox(k, pos, g)
        kc, vc = ctx[il]
        kk = torch.cat((kc, k.to(kc.dtype)), dim=1)  # [N, Tc+Tq, n_kv, hd]
        vv = torch.cat((vc, v.to(vc.dtype)), dim=1)
        dt = vv.dtype
        qh = q.to(dt).transpose(1, 2)  # [N, nh, Tq, hd]
        kh = kk.transpose(1, 2).repeat_interleave(rep, dim=1)  # q head i reads kv head i // rep (ggml broadcast)
        vh = vv.transpose(1, 2).repeat_interleave(rep, dim=1)
        am = None if mask is None else mask[:, None, :, :]
        a = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=am, scale=g.attn_scale)
        a = a.transpose(1, 2).reshape(N, Tq, g.n_heads * g.head_dim)
        o = F.linear(a, L["attn_output"])
        if g.value_scale != 0.0:
            o = o * g.value_scale
        x = x + o
        f = rms(x, g.eps) * L["ffn_norm"]
        x = x + F.linear(F.silu(F.linear(f, L["ffn_gate"])) * F.linear(f, L["ffn_up"]), L["ffn_down"])
    return rms(x, g.eps) * W["output_norm"]


def default_attn_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


__all__ = [
    "GLOBAL_TENSORS",
    "LAYER_TENSORS",
    "NetGeometry",
    "block_hidden",
    "context_kv",
    "default_attn_scale",
    "fuse",
    "rms",
    "rope_neox",
]
