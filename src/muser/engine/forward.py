"""The Muse Glimmer forward on torch, in llama.cpp's `muse-glimmer` graph order (book 9, 10;
src/models/muse-glimmer.cpp):

    embedding row -> weightless RMSNorm (eps) -> per layer:
        attn_norm -> Q, K, V, gate projections -> per-head QK-norm (eps; q weight = the
        constant qk_scale_factor, k weight = 1) -> RoPE (NORM pairing, theta from
        rope.freq_base_swa) on sliding layers only -> attention (scale 1/sqrt(head_dim), causal,
        p1 - p0 < W on sliding layers) -> sigmoid(gate) * attn -> o_proj -> RMSNorm eps 1e-8 *
        post_attention_norm -> + residual -> ffn_norm -> down(silu(gate x) * up x) -> RMSNorm
        eps 1e-8 * post_ffw_norm -> + residual
    final RMSNorm * output_norm -> LM head -> * logit_scale -> cap * tanh(l * (1/cap))

One forward serves prefill chunks, decode and verify; the KV side (attend over the plane, then
store the chunk's rows) is a strategy object, so the same code runs eagerly and inside a CUDA
graph. Lanes (engine/lanes.py) decide how projections are computed (and f16_attention, below).
"""

from __future__ import annotations


from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..errors import LaneError
from ..model.config import POST_NORM_EPS, MuseConfig
from ..model.loader import ModelFile
from .lanes import Lane, Linear
from .weights import QWeight, upload, vector


# ---------------------------------------------------------------------------------------------
# weights


@dataclass
class LayerWeights:
    sliding: bool
    attn_norm: torch.Tensor  # [hidden]
    wq: QWeight  # [attn_dim, hidden]
    wk: QWeight  # [kv_dim, hidden]
    wv: QWeight
    q_norm: torch.Tensor  # [head_dim]: the qk_scale_factor broadcast (book 9.9)
    k_norm: torch.Tensor  # [head_dim]: ones
    wgate: QWeight  # [attn_dim, hidden]
    wo: QWeight  # [hidden, attn_dim]
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_gate: QWeight  # [ffn, hidden]
    ffn_up: QWeight
    ffn_down: QWeight  # [hidden, ffn]
    post_ffw_norm: torch.Tensor
    # the projections that read one input, packed as one matrix (CUDA: kernels/qmatvec_v3.Stack,
    # v left out when its format differs; CPU: cpu_native.CpuStack; fast lane: lanes.FastStack):
    # attn_in = q|k|v|gate, ffn_in = gate|up
    attn_in: object | None = None
    attn_in_v: bool = False
    ffn_in: object | None = None

    def matrices(self) -> list[QWeight]:
        return [self.wq, self.wk, self.wv, self.wgate, self.wo, self.ffn_gate, self.ffn_up, self.ffn_down]


@dataclass
class ModelWeights:
    embd: QWeight  # token_embd [vocab, hidden]
    out_norm: torch.Tensor
    lm_head: QWeight  # output [vocab, hidden] (untied, book 9.11)
    layers: list[LayerWeights] = field(default_factory=list)

    def matrices(self) -> list[QWeight]:
        out = [self.embd, self.lm_head]
        for L in self.layers:
            out += L.matrices()
        return out

    @property
    def nbytes(self) -> int:
        """Resident bytes on the device: repacked matrices plus the f32 vectors."""
        n = sum(w.nbytes for w in self.matrices()) + self.out_norm.numel() * 4
        for L in self.layers:
            n += 4 * sum(t.numel() for t in (L.attn_norm, L.q_norm, L.k_norm, L.post_attn_norm,
                                             L.ffn_norm, L.post_ffw_norm))
        return n

    @classmethod
    def load(cls, mf: ModelFile, device: torch.device, progress=None, lane: Lane = Lane.EXACT) -> "ModelWeights":
        g, cfg = mf.gguf, mf.config
        # Refuse before uploading anything: every matrix must have an exact device decoder, and
        # in the fast lane every projection (not the embedding, read by rows) a vec_dot_type.
        from .weights import DEVICE_FORMATS
        for name, dt in mf.contract.dtypes.items():
            t = g.tensors[name]
            if len(t.shape) == 2 and t.type.ggml_type not in DEVICE_FORMATS:
                raise LaneError(
                    f"tensor {name!r}: dtype {dt} has no exact decoder in the engine "
                    f"(served: {', '.join(f.name for f in DEVICE_FORMATS)}); use the oracle"
                )
        if lane is Lane.FAST:
            from ..gguf.types import GgmlType
            from .lanes import fast_refusal

            fast_refusal({n: GgmlType(g.tensors[n].type.ggml_type) for n in mf.contract.dtypes
                          if len(g.tensors[n].shape) == 2 and n != "token_embd.weight"}, device.type == "cuda")

        def mat(name: str) -> QWeight:
            w = upload(g, name, device)
            if progress:
                progress(name)
            return w

        def vec(name: str) -> torch.Tensor:
            return vector(g, name, device)

        layers = []
        for il in range(cfg.n_layers):
            b = f"blk.{il}."
            layers.append(LayerWeights(
                sliding=cfg.swa_pattern[il],
                attn_norm=vec(b + "attn_norm.weight"),
                wq=mat(b + "attn_q.weight"), wk=mat(b + "attn_k.weight"), wv=mat(b + "attn_v.weight"),
                q_norm=vec(b + "attn_q_norm.weight"), k_norm=vec(b + "attn_k_norm.weight"),
                wgate=mat(b + "attn_gate.weight"), wo=mat(b + "attn_output.weight"),
                post_attn_norm=vec(b + "post_attention_norm.weight"),
                ffn_norm=vec(b + "ffn_norm.weight"),
                ffn_gate=mat(b + "ffn_gate.weight"), ffn_up=mat(b + "ffn_up.weight"),
                ffn_down=mat(b + "ffn_down.weight"),
                post_ffw_norm=vec(b + "post_ffw_norm.weight"),
            ))
        mw = cls(embd=mat("token_embd.weight"), out_norm=vec("output_norm.weight"),
                 lm_head=mat("output.weight"), layers=layers)
        if lane is Lane.FAST:
            mw.stack_for_fast()  # fields stay resident: the integer lane reads them (no v3 layout)
        elif device.type == "cuda":
            mw.pack_for_decode(drop_fields=True, split=lane is Lane.SPLIT)  # the only resident copy
            torch.cuda.empty_cache()
        elif device.type == "cpu":
            mw.stack_for_cpu()
        return mw

    def stack_for_cpu(self) -> None:
        """The projections that read one input as one matrix of the CPU GEMM
        (cpu_native.CpuStack): q|k|v|gate and ffn gate|up."""
        from .kernels.cpu_native import stack

        for L in self.layers:
            L.attn_in = stack([L.wq, L.wk, L.wv, L.wgate])
            L.attn_in_v = True
            L.ffn_in = stack([L.ffn_gate, L.ffn_up])

    def stack_for_fast(self) -> None:
        """The fast lane's stacks (lanes.FastStack, both devices): q|k|v|gate, or q|k|gate with v
        by itself when its vec_dot_type differs, and ffn gate|up."""
        from .lanes import fast_stack

        self._stack_layers(fast_stack)

    def _stack_layers(self, stack) -> None:
        """attn_in = stack(q|k|v|gate), or stack(q|k|gate) with v by itself when `stack` refuses
        the four (None: v's format or vec_dot_type differs); ffn_in = stack(gate|up)."""
        for L in self.layers:
            L.attn_in = stack([L.wq, L.wk, L.wv, L.wgate])
            L.attn_in_v = L.attn_in is not None
            if L.attn_in is None:
                L.attn_in = stack([L.wq, L.wk, L.wgate])
            L.ffn_in = stack([L.ffn_gate, L.ffn_up])

    def pack_for_decode(self, drop_fields: bool, split: bool = False) -> None:
        """The device layouts of the exact lanes: the v3 matvec's (kernels/qmatvec_v3) for every
        K-quant and NVFP4 matrix, or with `split` (lane split) the split GEMM's
        (kernels/qgemm_split) for the K-quants; and the stacks of projections that read one input.
        The embedding is read a row at a time and keeps its repacked form."""
        from .kernels import qgemm_split
        from .kernels.qmatvec_v3 import pack_matrices, stack

        mats = [w for w in self.matrices() if w is not self.embd]
        for w in mats:
            if split and qgemm_split.supports(w.fmt) and w.packed is None:
                w.packed = qgemm_split.pack(w)
                if drop_fields:
                    w.fields = {}
        pack_matrices(mats, drop_fields=drop_fields)
        self._stack_layers(stack)


# ---------------------------------------------------------------------------------------------
# ops (f32; one rounding per op, ggml's order)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_rms_norm: x * (1 / sqrt(mean(x^2) + eps)) over the last dim (book 12)."""
    ms = (x * x).mean(-1, keepdim=True)
    return x * torch.sqrt(ms + eps).reciprocal_()  # scale = 1.0f / sqrtf(mean + eps); x * scale


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))  # ggml_vec_sigmoid_f32: 1 / (1 + expf(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))  # ggml_silu_f32: x / (1 + expf(-x))


def rope_tables(n_pos: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin f32 [n_pos, head_dim/2] for positions 0..n_pos-1, built as ggml does
    (ggml-cpu ops.cpp ggml_rope_cache_init): theta_scale = powf(base, -2/n_dims) in f32,
    theta_i = p * theta_scale^i by repeated f32 multiplication; cos/sin of that f32 angle
    (evaluated in f64, rounded once to f32)."""
    half = head_dim // 2
    ts = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(head_dim)))
    theta = np.empty((n_pos, half), dtype=np.float32)
    theta[:, 0] = np.arange(n_pos, dtype=np.float32)
    for i in range(1, half):
        theta[:, i] = theta[:, i - 1] * ts
    t64 = theta.astype(np.float64)
    return np.cos(t64).astype(np.float32), np.sin(t64).astype(np.float32)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NORM (GPT-J) pairing: dims (2i, 2i+1) rotate together (book 9.7, rope.metal NORM).
    x [T, heads, D]; cos, sin [T, D/2]."""
    T, nh, D = x.shape
    p = x.view(T, nh, D // 2, 2)
    x0, x1 = p[..., 0], p[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).view(T, nh, D)


def softcap_logits(l: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """* logit_scale, then cap * tanh(l * (1/cap)): scale first, cap second (book 9.10;
    muse-glimmer.cpp: ggml_scale, ggml_scale(1/cap), ggml_tanh, ggml_scale(cap))."""
    l = l * scale
    if cap > 0:
        l = torch.tanh(l * float(np.float32(1.0) / np.float32(cap))) * cap
    return l


# ---------------------------------------------------------------------------------------------
# the forward


def _row_mode(out_rows: "str | torch.Tensor") -> tuple[torch.Tensor | None, str]:
    """(row-index tensor or None, mode): mode 'rows' for an index tensor, else the string."""
    if isinstance(out_rows, torch.Tensor):
        return out_rows, "rows"
    return None, out_rows


def _pick(h: torch.Tensor, mode: str, rows_idx: torch.Tensor | None) -> torch.Tensor:
    """The output rows of h [T, n]: the last one, or those rows_idx names (in its order)."""
    if mode == "last":
        return h[h.shape[0] - 1:]
    assert rows_idx is not None  # mode 'rows' carries its index tensor (_row_mode)
    return h.index_select(0, rows_idx)


def _reader(L: LayerWeights):
    """What reads a layer's normed input first: the stacked q|k|(v|)gate, or q by itself."""
    return L.attn_in if L.attn_in is not None else L.wq


class KvStep(Protocol):
    """Attend T new rows over layer il's plane, then store them (see kernels/attention.py). q and
    k arrive contiguous; v [T, KV, D] with each row's heads packed, rows possibly strided (a
    column slice of the stacked projection output)."""

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class Forward:
    """Model weights on a device plus the graph. Stateless across calls; the KV lives in the
    session's planes."""

    def __init__(self, cfg: MuseConfig, weights: ModelWeights, lane: Lane, device: torch.device):
        self.cfg = cfg
        self.w = weights
        self.lane = lane
        self.f16_attention = lane is Lane.FAST  # over f16 K/V: ggml-cpu's f16 q and p (kernels/attention.py)
        self.device = device
        self.linear = Linear(lane, device)
        # The fused element-wise tails in place of the torch op chains: Triton on CUDA
        # (kernels/fused.py), the C library on the CPU (kernels/cpu_native.py, whose fixed
        # reduction orders make the CPU lane row-invariant). The torch ops above stay as the
        # reference both are tested against.
        self.native = device.type == "cpu"
        self.fused = True
        if self.native:
            from .kernels import cpu_native

            self.tails = cpu_native
        else:
            from .kernels import fused

            self.tails = fused
        self._ones = torch.ones(cfg.hidden, dtype=torch.float32, device=device)  # the weightless entry norm
        self._cos = torch.empty((0, cfg.head_dim // 2), dtype=torch.float32, device=device)
        self._sin = self._cos

    # RoPE table on the device, grown on demand (book 10.8: built once, read by position)
    def ensure_positions(self, n: int) -> None:
        if self._cos.shape[0] >= n:
            return
        n = max(n, 2 * self._cos.shape[0], 256)
        c, s = rope_tables(n, self.cfg.head_dim, self.cfg.rope_base_swa)
        self._cos = torch.from_numpy(c).to(self.device)
        self._sin = torch.from_numpy(s).to(self.device)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KvStep, out_rows: "str | torch.Tensor",
            capture: tuple[int, ...] = (), captured: dict | None = None,
            logits_out: torch.Tensor | None = None, layer_hook=None) -> torch.Tensor | None:
        """tokens, positions: int64 [T] on the device. out_rows: 'last' | 'all' | 'none', or an
        int64 tensor of row indices (the LM head then runs on those rows only, llama.cpp's
        inp_out_ids). capture: layers whose input residual is recorded into `captured`
        (n_layers = the residual leaving the last layer). Returns logits f32 [R, vocab] (R = 1,
        T or len(out_rows)) or None. Capture-safe: no host sync, no host-built tensors.
        layer_hook(il), when given, runs before each layer (a graph capture splits there)."""
        rows_idx, out_rows = _row_mode(out_rows)
        cfg, W, lin = self.cfg, self.w, self.linear
        lin.forget_acts()
        if self.native:
            self.tails.follow_torch_threads()
        T = tokens.shape[0]
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        eps = cfg.rms_eps
        post_eps = float(POST_NORM_EPS)
        cos = self._cos.index_select(0, positions)  # [T, D/2]
        sin = self._sin.index_select(0, positions)
        h = W.embd.decode(tokens)  # [T, hidden]: the quantized table row, decoded exactly (ch 11)
        fz, FK = self.fused, self.tails
        # entry norm, weightless (muse-glimmer.cpp build_norm(.., nullptr)); * 1.0 is exact. A
        # row per program, as every norm of the fused path: torch's CUDA mean picks its block
        # width from the row count (ATen Reduce.cuh setReduceConfig), so its sum order would
        # depend on T and break row invariance
        h = FK.norm_mul(h, self._ones, eps) if fz else rms_norm(h, eps)
        last = len(W.layers) - 1
        final_capture = captured is not None and len(W.layers) in capture
        if fz:
            cos_c, sin_c = cos.contiguous(), sin.contiguous()
        x_next = None  # fused path: this layer's pre-norm, computed by the previous layer's tail
        for il, L in enumerate(W.layers):
            if layer_hook is not None:
                layer_hook(il)
            if il in capture and captured is not None:
                captured[il] = h  # the layer's input residual (t_layer_inp), what DFlash reads
            if x_next is not None:
                x = x_next
            elif fz:
                qa = lin.act_out(_reader(L), T, cfg.hidden)
                x = FK.norm_mul(h, L.attn_norm, eps, act=qa)
                lin.keep_act(x, qa)
            else:
                x = rms_norm(h, eps) * L.attn_norm
            qk_fused = fz and L.attn_in is not None and lin.stacked_ok(T, L.attn_in)
            if qk_fused:
                # one launch for q|k|(v|)gate, one for the q/k head norms + RoPE (book 9.7, 14)
                st = L.attn_in
                y = lin.stacked_raw(st, x)  # [T, sum n_out]
                (q0, _), (k0, _) = st.bounds[0], st.bounds[1]
                q, k = FK.qk_norm_rope(y, q0, k0, H, KV, D, L.q_norm, L.k_norm, eps,
                                       cos_c if L.sliding else None, sin_c if L.sliding else None)
                v = (y[:, st.bounds[2][0]:st.bounds[2][1]] if L.attn_in_v else lin(L.wv, x)).view(T, KV, D)
                g = y[:, st.bounds[-1][0]:st.bounds[-1][1]]
            else:
                q = lin(L.wq, x).view(T, H, D)
                k = lin(L.wk, x).view(T, KV, D)
                v = lin(L.wv, x).view(T, KV, D)
                g = lin(L.wgate, x)  # [T, attn_dim], from the same normed input (book 9.8)
            if not qk_fused and fz:  # the fused kernel over q|k side by side (one row per program)
                q, k = FK.qk_norm_rope(torch.cat([q.reshape(T, H * D), k.reshape(T, KV * D)], 1), 0, H * D,
                                       H, KV, D, L.q_norm, L.k_norm, eps,
                                       cos_c if L.sliding else None, sin_c if L.sliding else None)
            elif not qk_fused:
                q = rms_norm(q, eps) * L.q_norm  # per-head QK-norm (book 14)
                k = rms_norm(k, eps) * L.k_norm
                if L.sliding:
                    q = rope(q, cos, sin)
                    k = rope(k, cos, sin)
            # v may stay a row slice of the stacked q|k|v output: the graph step's rounding reads it
            # in place (a copy kernel a layer at T > 1 otherwise); the eager steps make it contiguous
            a = kv.attend(il, q.contiguous(), k.contiguous(), v)  # [T, H, D]
            if fz:
                qa = lin.act_out(L.wo, T, H * D)
                a = FK.gate_mul(a.reshape(T, H * D), g.contiguous() if g.stride(1) != 1 else g, act=qa)
                lin.keep_act(a, qa)
                o = lin(L.wo, a)
            else:
                a = a.reshape(T, H * D) * sigmoid(g)  # gate before o_proj (book 9.8)
                o = rms_norm(lin(L.wo, a), post_eps) * L.post_attn_norm  # sandwich, eps 1e-8 (9.9)
                h = o + h
            if il == last and out_rows != "all" and not final_capture:
                if out_rows == "none":
                    return None
                if fz:
                    o, h = _pick(o, out_rows, rows_idx), _pick(h, out_rows, rows_idx)
                else:
                    h = _pick(h, out_rows, rows_idx)  # llama.cpp inp_out_ids: only output rows from here
            if fz:  # sandwich tail + residual + the FFN pre-norm in one pass
                qa = lin.act_out(L.ffn_in if L.ffn_in is not None else L.ffn_gate, o.shape[0], cfg.hidden)
                h, x = FK.norm2(o, L.post_attn_norm, post_eps, h, L.ffn_norm, eps, act=qa)
                lin.keep_act(x, qa)
            else:
                x = rms_norm(h, eps) * L.ffn_norm
            if L.ffn_in is not None and lin.stacked_ok(T, L.ffn_in):
                fg, fu = lin.stacked(L.ffn_in, x)
            else:
                fg, fu = lin(L.ffn_gate, x), lin(L.ffn_up, x)
            if fz:
                qa = lin.act_out(L.ffn_down, fg.shape[0], cfg.ffn)
                f = FK.silu_mul(fg, fu, act=qa)
                lin.keep_act(f, qa)
                # sandwich tail + residual + the next layer's pre-norm (the output norm after
                # the last layer) in one pass
                w_next = W.layers[il + 1].attn_norm if il < last else W.out_norm
                qa = lin.act_out(_reader(W.layers[il + 1]) if il < last else W.lm_head, h.shape[0], cfg.hidden)
                h, x_next = FK.norm2(lin(L.ffn_down, f), L.post_ffw_norm, post_eps, h, w_next, eps, act=qa)
                lin.keep_act(x_next, qa)
            else:
                f = silu(fg) * fu
                f = rms_norm(lin(L.ffn_down, f), post_eps) * L.post_ffw_norm
                h = f + h
        if final_capture:
            captured[len(W.layers)] = h  # the residual leaving the last layer
            if out_rows == "none":
                return None
            if out_rows != "all":
                h = _pick(h, out_rows, rows_idx)
        if fz:
            if not final_capture or out_rows == "all":
                x = x_next
            else:
                qa = lin.act_out(W.lm_head, h.shape[0], cfg.hidden)
                x = FK.norm_mul(h.contiguous(), W.out_norm, eps, act=qa)
                lin.keep_act(x, qa)
        else:
            x = rms_norm(h, eps) * W.out_norm
        cap = FK.softcap if self.native else softcap_logits
        logits = cap(lin(W.lm_head, x), cfg.logit_scale, cfg.softcap)
        if logits_out is not None:
            logits_out.copy_(logits)
            return logits_out
        return logits
