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
graph. Lanes (engine/lanes.py) decide only how projections are computed.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..errors import LaneError
from ..model.config import POST_NORM_EPS, MuseConfig
from ..model.loader import ModelFile
from .lanes import Lane, Linear, cpu_concat
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
    # CUDA: the projections that read one input, packed as one matrix (kernels/qmatvec_v3.Stack):
    # attn_in = q|k|v|gate (v left out when its format differs), ffn_in = gate|up
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
    def load(cls, mf: ModelFile, device: torch.device, progress=None) -> "ModelWeights":
        g, cfg = mf.gguf, mf.config
        # Refuse before uploading anything: every matrix must have an exact device decoder.
        from .weights import DEVICE_FORMATS
        for name, dt in mf.contract.dtypes.items():
            t = g.tensors[name]
            if len(t.shape) == 2 and t.type.ggml_type not in DEVICE_FORMATS:
                raise LaneError(
                    f"tensor {name!r}: dtype {dt} has no exact decoder in the engine "
                    f"(served: {', '.join(f.name for f in DEVICE_FORMATS)}); use the oracle"
                )

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
        if device.type == "cuda" and os.environ.get("MUSER_MATVEC", "") in ("", "v3"):
            # the repacked fields stay only when older kernels are to be timed beside the decode
            # kernel (MUSER_MATVEC_COMPARE=1)
            mw.pack_for_decode(drop_fields=os.environ.get("MUSER_MATVEC_COMPARE") != "1")
            torch.cuda.empty_cache()
        return mw

    def pack_for_decode(self, drop_fields: bool) -> None:
        """The decode kernel's layout (kernels/qmatvec_v3) for every K-quant matrix, and the
        stacks of projections that read one input. The embedding is read a row at a time and
        keeps its repacked form."""
        from .kernels.qmatvec_v3 import pack_matrices, stack

        pack_matrices([w for w in self.matrices() if w is not self.embd], drop_fields=drop_fields)
        for L in self.layers:
            L.attn_in = stack([L.wq, L.wk, L.wv, L.wgate])
            L.attn_in_v = L.attn_in is not None
            if L.attn_in is None:
                L.attn_in = stack([L.wq, L.wk, L.wgate])
            L.ffn_in = stack([L.ffn_gate, L.ffn_up])


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
# the CPU forward for decode and verify shapes (T <= 16)
#
# The same graph as Forward.run with the per-op overhead cut: projections sharing an input are
# one GEMV over their stacked f32 decodes (Q|K|V|gate, ffn gate|up), Q and K are QK-normed and
# rotated as one [T, H + KV, D] tensor, elementwise steps run in place on fresh temporaries.
# Every element sees the same f32 operations as in `run` except the GEMV's summation order.

CPU_FAST_ROWS = 16  # the verify width (session.MAX_VERIFY); wider chunks take `run`


@dataclass
class _CpuLayer:
    sliding: bool
    attn_norm: torch.Tensor  # [hidden]
    w_qkvg: torch.Tensor  # f32 [attn_dim + 2 kv_dim + attn_dim, hidden]
    qk_norm: torch.Tensor  # [H + KV, D]: q_norm rows then k_norm rows
    wo: torch.Tensor  # f32 [hidden, attn_dim]
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    w_gu: torch.Tensor  # f32 [2 ffn, hidden]: gate rows then up rows
    w_down: torch.Tensor  # f32 [hidden, ffn]
    post_ffw_norm: torch.Tensor


def _rms_norm_cpu(x: torch.Tensor, eps: torch.Tensor, inv_n: torch.Tensor | None) -> torch.Tensor:
    """rms_norm with the scale chain in place: the same f32 ops, fewer allocations. torch's mean
    is sum then divide; for a power-of-two width the divide is the exact multiply by inv_n.
    eps, inv_n: 0-dim f32 tensors (a Python scalar operand costs a conversion per call)."""
    ms = (x * x).sum(-1, keepdim=True)
    ms = ms.div_(x.shape[-1]) if inv_n is None else ms.mul_(inv_n)
    return x * ms.add_(eps).sqrt_().reciprocal_()


def _inv_width(n: int) -> torch.Tensor | None:
    return torch.tensor(1.0 / n, dtype=torch.float32) if n & (n - 1) == 0 else None


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x f32 [T, n_in] @ w^T (w f32 [n_out, n_in]) -> [T, n_out]; one row through GEMV."""
    if x.shape[0] == 1:
        return torch.mv(w, x[0]).unsqueeze(0)
    return torch.mm(x, w.t())


def _rope_cpu(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`rope` writing both halves of each pair into one output (no stack). x [T, n, D];
    c, s [T, 1, D/2]."""
    T, nh, D = x.shape
    p = x.view(T, nh, D // 2, 2)
    x0, x1 = p[..., 0], p[..., 1]
    out = torch.empty_like(x)
    o = out.view(T, nh, D // 2, 2)
    torch.sub(x0 * c, x1 * s, out=o[..., 0])
    torch.add(x0 * s, x1 * c, out=o[..., 1])
    return out


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


class KvStep(Protocol):
    """Attend T new rows over layer il's plane, then store them (see kernels/attention.py)."""

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class Forward:
    """Model weights on a device plus the graph. Stateless across calls; the KV lives in the
    session's planes."""

    def __init__(self, cfg: MuseConfig, weights: ModelWeights, lane: Lane, device: torch.device):
        self.cfg = cfg
        self.w = weights
        self.lane = lane
        self.device = device
        self.linear = Linear(lane, device)
        self.cpu_fast = device.type == "cpu"  # the CPU small-T forward (run_cpu); off = reference
        # CUDA: the fused element-wise tails (kernels/fused.py) in place of the torch op chains
        self.fused = device.type == "cuda"
        self._cpu: list[_CpuLayer] | None = None
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
            logits_out: torch.Tensor | None = None) -> torch.Tensor | None:
        """tokens, positions: int64 [T] on the device. out_rows: 'last' | 'all' | 'none', or an
        int64 tensor of row indices (the LM head then runs on those rows only, llama.cpp's
        inp_out_ids). capture: layers whose input residual is recorded into `captured`
        (n_layers = the residual leaving the last layer). Returns logits f32 [R, vocab] (R = 1,
        T or len(out_rows)) or None. Capture-safe: no host sync, no host-built tensors."""
        if (self.cpu_fast and getattr(kv, "cpu_fast", False) and tokens.shape[0] <= CPU_FAST_ROWS
                and self._cpu_consts() is not None):  # eager CPU steps only (graph steps: below)
            return self.run_cpu(tokens, positions, kv, out_rows, capture, captured, logits_out)
        rows_idx, out_rows = _row_mode(out_rows)
        cfg, W, lin = self.cfg, self.w, self.linear
        T = tokens.shape[0]
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        eps = cfg.rms_eps
        post_eps = float(POST_NORM_EPS)
        cos = self._cos.index_select(0, positions)  # [T, D/2]
        sin = self._sin.index_select(0, positions)
        h = W.embd.decode(tokens)  # [T, hidden]: the quantized table row, decoded exactly (ch 11)
        h = rms_norm(h, eps)  # entry norm, weightless (muse-glimmer.cpp build_norm(.., nullptr))
        last = len(W.layers) - 1
        final_capture = captured is not None and len(W.layers) in capture
        fz = self.fused
        if fz:
            from .kernels import fused as FK
            cos_c, sin_c = cos.contiguous(), sin.contiguous()
        x_next = None  # fused path: this layer's pre-norm, computed by the previous layer's tail
        for il, L in enumerate(W.layers):
            if il in capture and captured is not None:
                captured[il] = h  # the layer's input residual (t_layer_inp), what DFlash reads
            if x_next is not None:
                x = x_next
            else:
                x = FK.norm_mul(h, L.attn_norm, eps) if fz else rms_norm(h, eps) * L.attn_norm
            qk_fused = fz and L.attn_in is not None and lin.stacked_ok(T)
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
            if not qk_fused:
                q = rms_norm(q, eps) * L.q_norm  # per-head QK-norm (book 14)
                k = rms_norm(k, eps) * L.k_norm
                if L.sliding:
                    q = rope(q, cos, sin)
                    k = rope(k, cos, sin)
            a = kv.attend(il, q.contiguous(), k.contiguous(), v.contiguous())  # [T, H, D]
            if fz:
                a = FK.gate_mul(a.reshape(T, H * D), g.contiguous() if g.stride(1) != 1 else g)
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
                h, x = FK.norm2(o, L.post_attn_norm, post_eps, h, L.ffn_norm, eps)
            else:
                x = rms_norm(h, eps) * L.ffn_norm
            if L.ffn_in is not None and lin.stacked_ok(T):
                fg, fu = lin.stacked(L.ffn_in, x)
            else:
                fg, fu = lin(L.ffn_gate, x), lin(L.ffn_up, x)
            if fz:
                f = FK.silu_mul(fg, fu)
                # sandwich tail + residual + the next layer's pre-norm (the output norm after
                # the last layer) in one pass
                w_next = W.layers[il + 1].attn_norm if il < last else W.out_norm
                h, x_next = FK.norm2(lin(L.ffn_down, f), L.post_ffw_norm, post_eps, h, w_next, eps)
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
            x = x_next if not final_capture or out_rows == "all" else FK.norm_mul(h.contiguous(), W.out_norm, eps)
        else:
            x = rms_norm(h, eps) * W.out_norm
        logits = softcap_logits(lin(W.lm_head, x), cfg.logit_scale, cfg.softcap)
        if logits_out is not None:
            logits_out.copy_(logits)
            return logits_out
        return logits

    def _cpu_consts(self) -> list[_CpuLayer] | None:
        """Per-layer constants of the CPU forward, built once; None when the f32 decodes would
        exceed the CPU cache budget (then `run` decodes in row chunks)."""
        if self._cpu is not None:
            return self._cpu or None
        lin, W, cfg = self.linear, self.w, self.cfg
        out: list[_CpuLayer] = []
        for L in W.layers:
            mats = [cpu_concat(lin, [L.wq, L.wk, L.wv, L.wgate]), cpu_concat(lin, [L.wo]),
                    cpu_concat(lin, [L.ffn_gate, L.ffn_up]), cpu_concat(lin, [L.ffn_down])]
            if any(m is None for m in mats):
                self._cpu = []
                return None
            qk = torch.cat([L.q_norm.expand(cfg.n_heads, cfg.head_dim),
                            L.k_norm.expand(cfg.n_kv_heads, cfg.head_dim)], 0).contiguous()
            out.append(_CpuLayer(L.sliding, L.attn_norm, mats[0], qk, mats[1], L.post_attn_norm,
                                 L.ffn_norm, mats[2], mats[3], L.post_ffw_norm))
        embd = cpu_concat(lin, [W.embd])  # the table decoded once (the same exact decoder, ch 11)
        if embd is None or cpu_concat(lin, [W.lm_head]) is None:
            self._cpu = []
            return None
        self._cpu_embd = embd
        f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
        # the f32 values the scalar ops round their operands to
        self._cpu_scalars = (f32(cfg.rms_eps), f32(float(POST_NORM_EPS)), f32(1.0),
                             _inv_width(cfg.hidden), _inv_width(cfg.head_dim))
        self._cpu = out
        return out

    def run_cpu(self, tokens: torch.Tensor, positions: torch.Tensor, kv: KvStep, out_rows: "str | torch.Tensor",
                 capture: tuple[int, ...] = (), captured: dict | None = None,
                 logits_out: torch.Tensor | None = None) -> torch.Tensor | None:
        """run() for T <= CPU_FAST_ROWS on the CPU (same arguments, same results up to f32
        summation order)."""
        rows_idx, out_rows = _row_mode(out_rows)
        cfg, W, lin = self.cfg, self.w, self.linear
        layers = self._cpu
        T = tokens.shape[0]
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        A, KD = H * D, KV * D
        eps, post_eps, one, inv_h, inv_d = self._cpu_scalars
        cos = self._cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D/2]
        sin = self._sin.index_select(0, positions).unsqueeze(1)
        h = _rms_norm_cpu(self._cpu_embd.index_select(0, tokens), eps, inv_h)  # [T, hidden]
        last = len(layers) - 1
        final_capture = captured is not None and len(layers) in capture
        for il, L in enumerate(layers):
            if il in capture and captured is not None:
                captured[il] = h
            x = _rms_norm_cpu(h, eps, inv_h).mul_(L.attn_norm)
            y = _mm(x, L.w_qkvg)  # [T, A | KD | KD | A]
            qk = y[:, :A + KD].view(T, H + KV, D)
            qk = _rms_norm_cpu(qk, eps, inv_d).mul_(L.qk_norm)  # QK-norm, q and k at once (book 14)
            if L.sliding:
                qk = _rope_cpu(qk, cos, sin)
            v = y[:, A + KD:A + 2 * KD].reshape(T, KV, D)
            a = kv.attend(il, qk[:, :H], qk[:, H:].contiguous(), v)  # [T, H, D]
            g = y[:, A + 2 * KD:]
            sg = torch.exp(-g).add_(one).reciprocal_()  # sigmoid: 1 / (1 + expf(-x))
            a = a.reshape(T, A) * sg  # gate before o_proj (book 9.8)
            o = _rms_norm_cpu(_mm(a, L.wo), post_eps, inv_h).mul_(L.post_attn_norm)
            h = o.add_(h)
            if il == last and out_rows != "all" and not final_capture:
                if out_rows == "none":
                    return None
                h = _pick(h, out_rows, rows_idx)
            x = _rms_norm_cpu(h, eps, inv_h).mul_(L.ffn_norm)
            gu = _mm(x, L.w_gu)  # [T, 2 ffn]
            gt = gu[:, :cfg.ffn]
            f = gt / torch.exp(-gt).add_(one)  # silu: x / (1 + expf(-x))
            f = f.mul_(gu[:, cfg.ffn:])
            f = _rms_norm_cpu(_mm(f, L.w_down), post_eps, inv_h).mul_(L.post_ffw_norm)
            h = f.add_(h)
        if final_capture:
            captured[len(layers)] = h
            if out_rows == "none":
                return None
            if out_rows != "all":
                h = _pick(h, out_rows, rows_idx)
        x = _rms_norm_cpu(h, eps, inv_h).mul_(W.out_norm)
        logits = softcap_logits(_mm(x, cpu_concat(lin, [W.lm_head])), cfg.logit_scale, cfg.softcap)
        if logits_out is not None:
            logits_out.copy_(logits)
            return logits_out
        return logits
