"""The CPU oracle: the Muse Glimmer forward in numpy, the bit-level spec (book 9.1, 10, 12-19).

Graph order is llama.cpp's `muse-glimmer` (src/models/muse-glimmer.cpp), Figure 10.1:
embedding row -> weightless entry RMSNorm (rms_eps) -> per layer: attn_norm; Q/K/V/gate
projections of the same normed input; per-head QK-norm (q_norm constant, k_norm ones); RoPE on
sliding layers only (NORM pairing, rope.freq_base_swa); attention (scale 1/sqrt(head_dim),
causal, window p1 - p0 < W on sliding layers, GQA); sigmoid gate before o_proj; post-attention
norm (eps 1e-8); residual; ffn_norm; SwiGLU; post-FFN norm (eps 1e-8); residual -> final norm ->
LM head -> x logit_scale -> softcap.

Attention mirrors llama.cpp's non-flash path (build_attn_mha: kq = mul_mat(k, q), soft_max_ext,
kqv = mul_mat(v, kq)), the path the comparator runs (flash_attn=False): its F32-KV variant has no
rounding point at all, unlike flash attention, which casts an F32 K/V to F16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import LaneError
from ..gguf.types import GgmlType as G
from ..kv import KvCache
from ..model.config import POST_NORM_EPS, MuseConfig
from ..model.loader import ModelFile
from . import numerics as nm

F32 = np.float32
F64 = np.float64

_CONTROLLER = None


def single_thread_blas():
    """The oracle's dots run on one BLAS thread: the results do not depend on it (each output
    element is one float64 dot), and a multi-threaded BLAS spin-waiting on a small shared
    machine is an order of magnitude slower (threadpoolctl scopes the limit)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=1, user_api="blas")


PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_gate", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class Linear:
    name: str
    w: np.ndarray  # float64 [n_out, n_in]: the dequantized weight, exact in float64
    dtype: G  # stored type: decides the activation rounding point (ggml-cpu mode)


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray
    q: Linear
    k: Linear
    v: Linear
    gate: Linear
    o: Linear
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_attn_norm: np.ndarray
    ffn_norm: np.ndarray
    ffn_gate: Linear
    ffn_up: Linear
    ffn_down: Linear
    post_ffw_norm: np.ndarray


class OracleWeights:
    """Every weight dequantized once (through muser.quant), kept as float64 for the dots."""

    def __init__(self, mf: ModelFile):
        from ..quant import dequantize_rows, dequantize_tensor  # the codecs, bit-exact to ggml

        f = mf.gguf
        self._f = f
        self._rows = dequantize_rows
        self.embd_type = f.tensor_info("token_embd.weight").type.ggml_type

        def vec(name: str) -> np.ndarray:
            return np.ascontiguousarray(dequantize_tensor(f, name), dtype=F32)

        def lin(name: str) -> Linear:
            return Linear(name, np.asarray(dequantize_tensor(f, name), dtype=F64),
                          f.tensor_info(name).type.ggml_type)

        self.output_norm = vec("output_norm.weight")
        self.output = lin("output.weight")
        self.layers: list[LayerWeights] = []
        for il in range(mf.config.n_layers):
            b = f"blk.{il}."
            self.layers.append(LayerWeights(
                attn_norm=vec(b + "attn_norm.weight"),
                q=lin(b + "attn_q.weight"), k=lin(b + "attn_k.weight"), v=lin(b + "attn_v.weight"),
                gate=lin(b + "attn_gate.weight"), o=lin(b + "attn_output.weight"),
                q_norm=vec(b + "attn_q_norm.weight"), k_norm=vec(b + "attn_k_norm.weight"),
                post_attn_norm=vec(b + "post_attention_norm.weight"),
                ffn_norm=vec(b + "ffn_norm.weight"),
                ffn_gate=lin(b + "ffn_gate.weight"), ffn_up=lin(b + "ffn_up.weight"),
                ffn_down=lin(b + "ffn_down.weight"),
                post_ffw_norm=vec(b + "post_ffw_norm.weight"),
            ))

    def linears(self) -> list[Linear]:
        out = [self.output]
        for lw in self.layers:
            out += [lw.q, lw.k, lw.v, lw.gate, lw.o, lw.ffn_gate, lw.ffn_up, lw.ffn_down]
        return out

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """ggml_get_rows on token_embd: the dequantized rows (ggml-base to_float) [T, hidden]."""
        return np.ascontiguousarray(self._rows(self._f, "token_embd.weight", tokens), dtype=F32)


@dataclass
class ChunkOut:
    logits: np.ndarray | None  # [T, vocab] f32 (all rows or only the last)
    hidden: dict[int, np.ndarray]  # layer -> [T, hidden] input of that layer


class OracleForward:
    """Stateless graph evaluation over a KvCache; the session owns state and validation."""

    def __init__(self, cfg: MuseConfig, weights: OracleWeights, arith: nm.Arithmetic):
        self.cfg = cfg
        self.w = weights
        self.arith = arith
        if arith.rounds:
            for lin in weights.linears():
                if lin.dtype not in nm.VEC_DOT_TYPE:
                    raise LaneError(
                        f"arithmetic ggml-cpu: tensor {lin.name!r} is {lin.dtype.name}, which the "
                        "pinned llama.cpp CPU backend cannot multiply"
                    )

    # -- pieces --------------------------------------------------------------------------------
    def _mm(self, x: np.ndarray, *lins: Linear) -> list[np.ndarray]:
        """x through each weight; the activation rounding is done once per vec_dot_type, as
        ggml quantizes each matmul's src1 (identically) for Q/K/V/gate and for up/gate."""
        rounded: dict[G, np.ndarray] = {}
        out = []
        for lin in lins:
            key = nm.VEC_DOT_TYPE.get(lin.dtype, lin.dtype)
            if key not in rounded:
                rounded[key] = self.arith.activation(x, lin.dtype)
            out.append(nm.matmul(rounded[key], lin.w, self.arith.reduction))
        return out

    def _norm(self, x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        return self.arith.site(nm.rms_norm(x, w, eps))

    def _attention(self, cache: KvCache, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                   positions: np.ndarray) -> np.ndarray:
        """q [T, n_heads, hd], k/v [T, n_kv, hd] -> [T, n_heads*hd]; appends k/v to the cache."""
        cfg, a = self.cfg, self.arith
        T = q.shape[0]
        hd, nkv, hpk = cfg.head_dim, cfg.n_kv_heads, cfg.heads_per_kv
        sliding = cfg.swa_pattern[il]
        old = cache.view(il)  # visible rows before this chunk (a ring holds <= W of them)
        k_rows = a.site(k.reshape(T, nkv * hd))
        v_rows = a.site(v.reshape(T, nkv * hd))
        # store first, read back: this chunk's rows enter attention at the KV type's precision
        k_new = cache.backend.round_to(k_rows, cache.dtype)
        v_new = cache.backend.round_to(v_rows, cache.dtype)
        cache.append_batch(il, int(positions[0]), k_rows, v_rows)
        keys = np.concatenate([np.asarray(old.keys, dtype=F32), k_new]).reshape(-1, nkv, hd)
        vals = np.concatenate([np.asarray(old.values, dtype=F32), v_new]).reshape(-1, nkv, hd)
        kpos = np.concatenate([old.positions, positions])
        # causal + LLAMA_SWA_TYPE_STANDARD window (llama-hparams.h is_masked_swa): p0 <= p1,
        # and p1 - p0 < W on sliding layers
        diff = positions[:, None] - kpos[None, :]  # [T, n_keys]
        mask = diff >= 0
        if sliding:
            mask &= diff < cfg.sliding_window
        qq = a.attn_query(a.site(q))
        out = np.empty((T, cfg.n_heads, hd), dtype=F32)
        for g in range(nkv):
            qg = qq[:, g * hpk:(g + 1) * hpk, :].transpose(1, 0, 2)  # [hpk, T, hd]
            kg = keys[:, g, :]  # [n_keys, hd]: the KV head GQA group g shares
            scores = nm.dot(qg, kg.T, a.reduction)  # [hpk, T, n_keys]
            p = nm.softmax_rows(scores, cfg.attn_scale, mask[None, :, :])
            p = a.attn_probs(a.site(p))
            og = nm.dot(p, vals[:, g, :], a.reduction)  # [hpk, T, hd]
            out[:, g * hpk:(g + 1) * hpk, :] = og.transpose(1, 0, 2)
        return out.reshape(T, cfg.n_heads * hd)

    # -- the graph -----------------------------------------------------------------------------
    def chunk(self, cache: KvCache, tokens: np.ndarray, start: int, want_logits: str,
              capture: Sequence[int] = ()) -> ChunkOut:
        """Run `tokens` (positions start..start+T-1) through every layer, appending K/V.
        want_logits: "all" | "last" | "none"."""
        cfg, a = self.cfg, self.arith
        T = len(tokens)
        positions = np.arange(start, start + T, dtype=np.int64)
        eps = cfg.rms_eps
        x = self._norm(self.w.embed(tokens), None, eps)  # weightless entry norm
        hidden: dict[int, np.ndarray] = {}
        cos = sin = None
        if any(cfg.swa_pattern):
            cos, sin = nm.rope_cache(positions, cfg.rope_base_swa, cfg.head_dim)
        for il, lw in enumerate(self.w.layers):
            if il in capture:
                hidden[il] = x.copy()  # res->t_layer_inp[il]: the residual entering layer il
            h = self._norm(x, lw.attn_norm, eps)
            q, k, v, g = self._mm(h, lw.q, lw.k, lw.v, lw.gate)  # one normed input, four weights
            q = q.reshape(T, cfg.n_heads, cfg.head_dim)
            k = k.reshape(T, cfg.n_kv_heads, cfg.head_dim)
            v = v.reshape(T, cfg.n_kv_heads, cfg.head_dim)
            q = self._norm(q, lw.q_norm, eps)  # per-head QK-norm (book 14.3)
            k = self._norm(k, lw.k_norm, eps)
            if cfg.swa_pattern[il]:  # RoPE only on sliding layers (muse-glimmer.cpp use_rope)
                q = nm.rope_norm(q, cos, sin)
                k = nm.rope_norm(k, cos, sin)
            att = self._attention(cache, il, q, k, v, positions)
            att = a.site(att * nm.sigmoid(g))  # sigmoid gate before o_proj (book 9.8)
            (o,) = self._mm(att, lw.o)
            o = self._norm(o, lw.post_attn_norm, POST_NORM_EPS)  # sandwich post-norm, 1e-8
            x = o + x
            h = self._norm(x, lw.ffn_norm, eps)
            up, gt = self._mm(h, lw.ffn_up, lw.ffn_gate)
            f = a.site(nm.swiglu(gt, up))
            (d,) = self._mm(f, lw.ffn_down)
            d = self._norm(d, lw.post_ffw_norm, POST_NORM_EPS)
            x = d + x
        if cfg.n_layers in capture:
            hidden[cfg.n_layers] = x.copy()
        if want_logits == "none":
            return ChunkOut(None, hidden)
        rows = x if want_logits == "all" else x[-1:]
        h = self._norm(rows, self.w.output_norm, eps)
        (z,) = self._mm(h, self.w.output)
        logits = nm.logit_tail(z, cfg.logit_scale, cfg.softcap)
        return ChunkOut(logits, hidden)
