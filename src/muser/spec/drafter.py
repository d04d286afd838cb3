"""The DFlash drafter on a device (torch, CPU or CUDA: the same code), and its per-sequence context.

    d = Drafter.load(path, target_engine)         # validated against the target before any upload
    ctx = d.context()                             # sink 64 + the trained window (book 8.3)
    d.inject(ctx, features, p0)                   # target layer-input rows [T, n_cap*H] at p0..p0+T-1
    d.propose(ctx, last_token, k)                 # k greedy proposals from one block forward
    ctx.truncate(n)                               # drop rows >= n (a rejected suffix)

The context keeps, per draft layer, the injected K/V of rows [0, 64) (the sink) and a ring of the
last window + 16 rows, so a rollback of up to one block (<= 16 rows) never loses a row the trailing
window needs, across the ring's wrap. A block at position n attends to the sink rows and the trailing
`window` committed rows (positions [max(64, n - window), n)), plus its own rows, non-causally.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..errors import ContractError, KvStateError, LaneError
from ..gguf.identity import artifact_sha256, tokenizer_sha256
from ..quant.dequant import dequantize_tensor
from .format import VERIFY_LENGTHS, DrafterConfig, check_fits, open_drafter
from .net import block_hidden, context_kv, fuse
from .policy import check_fallback_b

MAX_BLOCK = 16  # the verify shape (engine.session.MAX_VERIFY)


class DraftContext:
    """One sequence's drafter context: injected K/V rows by position (sink + ring)."""

    def __init__(self, drafter: Drafter):
        cfg = drafter.cfg
        self.d = drafter
        self.sink = cfg.sink
        self.window = cfg.window
        self.ring = cfg.window + MAX_BLOCK
        shape = (cfg.n_layers, self.sink + self.ring, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=drafter.device)  # [L, sink+ring, n_kv, hd]
        self.v = torch.zeros(shape, dtype=torch.float32, device=drafter.device)
        self.n = 0  # rows [0, n) are committed

    def _slots(self, pos: torch.Tensor) -> torch.Tensor:
        return torch.where(pos < self.sink, pos, self.sink + (pos - self.sink) % self.ring)

    def _span(self, lo: int, hi: int) -> torch.Tensor:
        # built on the device (no host-to-device copy, which on CUDA waits for the stream)
        return torch.arange(lo, max(lo, hi), dtype=torch.int64, device=self.k.device)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.n:
            raise KvStateError(f"drafter context has {self.n} rows, cannot truncate to {n}")
        self.n = n

    def visible(self, n: int) -> torch.Tensor:
        """Positions a block at position n reads: the sink and the trailing window (on the device)."""
        return torch.cat((self._span(0, min(self.sink, n)), self._span(max(self.sink, n - self.window), n)))


def check_pair(path: str | os.PathLike, model_file, receipts: Path | None = None):
    """Validate a drafter file against a target ModelFile before any weights move: the sidecar
    contract, the fit (width, layers, vocabulary, tokenizer) and Fallback B. Returns the open
    drafter GGUF (the caller closes it), its config and its SHA-256."""
    f, cfg = open_drafter(path)
    try:
        check_fits(cfg, model_file.config, tokenizer_sha256(f), tokenizer_sha256(model_file.gguf))
        sha = artifact_sha256(path)
        ident = model_file.identity
        check_fallback_b(ident.dtype_mix, ident.artifact_sha256, sha, receipts)
        return f, cfg, sha
    except BaseException:
        f.close()
        raise


class Drafter:
    def __init__(self, cfg: DrafterConfig, weights: dict, embd: torch.Tensor, head: torch.Tensor,
                 device: torch.device, sha256: str):
        self.cfg = cfg
        self.net = cfg.net()
        self.W = weights
        self.embd = embd  # [vocab, H] f32
        self.head = head  # [vocab, H] f32
        self.device = device
        self.sha256 = sha256

    @classmethod
    def load(cls, path: str | os.PathLike, engine, receipts: Path | None = None) -> Drafter:
        """Open, validate against `engine`'s target (geometry, vocabulary, tokenizer; Fallback B with
        the qualified receipts under `receipts`), then upload."""
        f, cfg, sha = check_pair(path, engine.model_file, receipts)
        try:
            tf = engine.model_file.gguf
            dev = engine.device

            def t(src, name):
                return torch.from_numpy(np.ascontiguousarray(dequantize_tensor(src, name), dtype=np.float32)).to(dev)

            W = {"fc": t(f, "fc.weight"), "enc.output_norm": t(f, "enc.output_norm.weight"),
                 "output_norm": t(f, "output_norm.weight"), "layers": []}
            for il in range(cfg.n_layers):
                W["layers"].append({n: t(f, f"blk.{il}.{n}.weight") for n in (
                    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
            for L in W["layers"]:
                for name, w in L.items():
                    if not torch.isfinite(w).all():
                        raise ContractError(f"drafter tensor {name!r} has non-finite values")
            # the target's embedding / LM head unless the drafter ships its own (dflash.cpp: ctx_other)
            embd = t(f, "token_embd.weight") if cfg.own_embedding else t(tf, "token_embd.weight")
            head = t(f, "output.weight") if cfg.own_head else t(tf, "output.weight")
            return cls(cfg, W, embd, head, dev, sha)
        finally:
            f.close()

    def context(self) -> DraftContext:
        return DraftContext(self)

    @torch.inference_mode()
    def inject(self, ctx: DraftContext, features: np.ndarray, p0: int) -> None:
        """Append target features [T, n_cap*H] (positions p0..p0+T-1, p0 == ctx.n) as context rows.
        Only rows a later block can read (the sink, and the last window + 16) are computed."""
        if p0 != ctx.n:
            raise KvStateError(f"drafter context holds {ctx.n} rows, injection starts at {p0}")
        T = features.shape[0]
        if features.shape != (T, self.cfg.n_capture * self.cfg.hidden):
            raise LaneError(f"drafter features have shape {list(features.shape)}, expected "
                            f"[T, {self.cfg.n_capture * self.cfg.hidden}]")
        # the rows kept: the sink's [p0, a1) and the ring's last rows [b0, p0 + T), disjoint
        a1 = min(ctx.sink, p0 + T)
        b0 = max(p0, p0 + T - ctx.ring, a1)
        rows = np.concatenate((features[: max(0, a1 - p0)], features[b0 - p0:]))
        if rows.shape[0]:
            x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(self.device)
            fz = fuse(self.W, x, self.net)  # [t, H]
            p = torch.cat((ctx._span(p0, a1), ctx._span(b0, p0 + T)))  # [t]
            slots = ctx._slots(p)
            for il in range(self.cfg.n_layers):
                k, v = context_kv(self.W, il, fz, p, self.net)  # [t, n_kv, hd]
                ctx.k[il, slots] = k.float()
                ctx.v[il, slots] = v.float()
        ctx.n = p0 + T

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, last: int, k: int) -> list[int]:
        """Greedy proposals for positions n+1..n+k from the block [last, mask x (block-1)] at
        positions n..n+block-1 (n = ctx.n), one forward (book 8.6 item 3)."""
        if k not in VERIFY_LENGTHS or k > self.cfg.max_proposals:
            raise LaneError(f"verify length {k!r} must be one of {VERIFY_LENGTHS} and <= block_size - 1 = "
                            f"{self.cfg.max_proposals}")
        B, n = self.cfg.block_size, ctx.n
        vis = ctx._slots(ctx.visible(n))
        toks = torch.full((1, B), self.cfg.mask_token, dtype=torch.int64, device=self.device)
        toks[0, 0] = int(last)
        pos = torch.arange(n, n + B, dtype=torch.int64, device=self.device)[None]
        kv = [(ctx.k[il, vis][None], ctx.v[il, vis][None]) for il in range(self.cfg.n_layers)]
        hid = block_hidden(self.W, self.embd[toks], pos, kv, self.net)  # [1, B, H]
        logits = hid[0, 1:k + 1] @ self.head.T  # [k, vocab]; scale/softcap are monotone (dflash.cpp)
        return [int(x) for x in torch.argmax(logits, dim=-1).tolist()]


__all__ = ["MAX_BLOCK", "DraftContext", "Drafter", "check_pair"]
