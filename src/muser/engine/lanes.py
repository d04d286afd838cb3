"""Lanes and how a projection is computed on each (DESIGN.md "Exactness contract").

* exact: f32 activations and f32 accumulation against the weights' exact values. On CUDA every
  call is row-invariant: weights in the packed layout (K-quants, NVFP4) run the fused Triton
  dequant-matvec in slices of <= 16 rows at every row count, which factors each K-quant unit's
  scale out of its dot (kernels/qmatvec_v3.py: d1 sum q x - m1 sum x in one order for every row
  count, so a row's bits are those it has decoded alone); other formats run their matvec in
  16-row slices at every row count too.
* split: the exact lane's contract (Gate 2 against the oracle's f32 arithmetic), with every K-quant
  projection on CUDA through the split-activation integer GEMM (kernels/qgemm_split.py: the
  activations as three base-254 digits per 256-block, exact integer sums, one fixed f32 order of
  super-block terms), at every row count: a token's logits are bitwise the same decoded alone,
  verified, prefilled in chunks of any size or batched. CUDA only (refused on the CPU, whose exact
  lane is row-invariant already); files with a projection in another format are refused at open. Slower than `exact` today (bench/NOTES.md).
* fast (the integer lane): every projection, at every row count, on both devices, computes
  `muser.quant.dot.matmul_ggml` bit for bit: the activations are converted to the weight type's
  vec_dot_type (Q8_K per 256 for the K-quants, Q8_0 per 32 for Q8_0/Q4_0/NVFP4), integer block
  sums, per-block terms summed in two fixed levels in block order (K-quants: float32 terms and
  sums; Q8_0/Q4_0/NVFP4: float64, one f32 rounding), ggml-cpu quants.c ggml_vec_dot_*'s
  products in one fixed order. CUDA: kernels/qtile_i8.py for the K-quants (int8 tensor-core tiles with the
  operands unpacked in registers; checked bitwise against qmatmul_i8 on the device before it
  serves) on the tiling the device sweep's table (kernels/i8_tuning.json) gives each shape,
  kernels/qmatmul_i8.py for Q8_0/Q4_0; the activations come quantized from the tail kernel that
  writes them (the norms and gates, kernels/fused.py through act_out / keep_act), a quantize
  launch only where no tail wrote them; CPU: dot.matmul_codes over codes built once
  from the repacked fields. Each output row depends only on its own input row, so the lane is
  row-invariant by construction. F32/F16/BF16 weights: the activations are rounded to the
  vec_dot_type (f16/bf16 round-to-nearest-even, f32 as is) and the exact lane's fixed-order f32
  sum runs (not the oracle's f64: a few ulps); on CUDA always through the fused matvec, in slices
  of <= 16 rows, so these weights stay row-invariant at every row count too. Gate 2 of the fast lane compares it
  with the oracle's "ggml-cpu" arithmetic (muser.gates.gate2).

On the CPU every exact-lane projection runs the C library's GEMM (kernels/cpu_native.py: one
fixed reduction order per output, whatever the row count or thread count, so the lane is
row-invariant), reading Q8_0 as stored, NVFP4 as int8 codes with its scales (values bit-equal
to the decoder's) and other formats as their exact f32 decode, cached once per weight within a
byte budget; beyond it each call decodes row chunks. The fast lane's integer codes are cached
under the same budget; beyond it each call builds the codes of row chunks.
"""

from __future__ import annotations

from enum import Enum

import numpy as np
import torch

from ..errors import LaneError
from ..gguf.types import GgmlType as G
from ..quant import dot
from .kernels import qmatvec
from .weights import QWeight

FLOAT_FORMATS = (G.F32, G.F16, G.BF16)


class Lane(str, Enum):
    EXACT = "exact"
    FAST = "fast"
    W4A4 = "w4a4"  # exact, except verify-shaped calls on W4A4 weights: FP4 activations (engine/w4a4.py)
    SPLIT = "split"  # exact-lane contract (Gate 2 vs f32) through kernels/qgemm_split: K-quant projections
    # row-invariant at every row count on CUDA (activations as base-254 digits, exact integer sums)

    @classmethod
    def parse(cls, value: str) -> "Lane":
        try:
            return cls(value)
        except ValueError:
            raise LaneError(f"unknown lane {value!r} (expected 'exact', 'fast', 'w4a4' or 'split')") from None


DEVICES = ("cpu", "cuda")
KV_TYPES = ("f16", "f32")

# The lane a caller gets when it names none (bench/NOTES.md, "The default lane"): the exact lane,
# unless another gated lane serves a request measurably faster on that device. CUDA, full geometry,
# one H100, both lanes' Gate 2 passing: decode a tie (exact 98.47, integer 98.19 tok/s), the first
# token of a 16-token prompt 55.0 against 17.8 ms, verify16 5.74 against 1.87 decodes, pp512 1,629
# tok/s in the integer lane (the exact lane's 306 on another H100). CPU, the shipped micro model:
# no measured difference (the integer lane's decode 0.97x inside a CV of 0.16, prefill 1.14x).
DEFAULT_LANES = {"cpu": "exact", "cuda": "fast"}


def default_lane(device: str) -> str:
    """The lane for `device` when none is named (DEFAULT_LANES); an unknown device is refused."""
    if device not in DEFAULT_LANES:
        raise LaneError(f"unknown device {device!r} (expected 'cpu' or 'cuda')")
    return DEFAULT_LANES[device]


def resolve_lane(lane: str | None, device: str) -> str:
    """`lane` as named, or the device's default lane when it is None."""
    return default_lane(device) if lane is None else lane


def parse_device(value: str) -> torch.device:
    if value not in DEVICES:
        raise LaneError(f"unknown device {value!r} (expected 'cpu' or 'cuda')")
    if value == "cuda":
        if not torch.cuda.is_available():
            raise LaneError("device 'cuda' was requested but torch sees no CUDA device")
        if not qmatvec.HAVE_TRITON:
            raise LaneError("device 'cuda' needs Triton for the engine's kernels; it is not installed")
        # Exact lane: no TF32 anywhere (f32 GEMMs stay f32).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parse_kv(value: str) -> str:
    if value not in KV_TYPES:
        raise LaneError(f"unknown KV type {value!r} (expected 'f16' or 'f32')")
    return value


CHUNK_BYTES = 256 << 20  # decoded temporary per row chunk (the CPU's GEMM past its cache budget)
CPU_CACHE_BYTES = 8 << 30  # decoded-weight cache budget on the CPU


def fast_refusal(formats: dict[str, G], cuda: bool) -> None:
    """Refuse (LaneError, before anything is uploaded) the projections the fast lane cannot
    compute as matmul_ggml does: formats with no vec_dot_type (the NVFP4 companion form), and on
    CUDA the integer formats kernels/qmatmul_i8.py does not serve. `formats`: tensor -> type."""
    none = {n: f for n, f in formats.items() if f not in dot.VEC_DOT_TYPE}
    if none:
        n, f = next(iter(none.items()))
        raise LaneError(f"lane 'fast': tensor {n!r} is {f.name}, which has no ggml vec_dot_type "
                        f"({len(none)} such tensors); use lane 'exact'")
    if cuda:
        from .kernels import qmatmul_i8

        off = sorted({f.name for f in formats.values() if f not in FLOAT_FORMATS and not qmatmul_i8.supports(f)})
        if off:
            n = next(n for n, f in formats.items() if f.name == off[0])
            raise LaneError(f"lane 'fast' on cuda: the integer kernel does not serve {', '.join(off)} "
                            f"(tensor {n!r}); use lane 'exact' or the cpu")


class FastStack:
    """Projections that read one input, as one call of the fast lane: each run of consecutive
    members of one format becomes one weight, their repacked fields concatenated along rows
    (each member's fields become row views of it, no second copy), and x is converted to the
    vec_dot_type once for the whole stack (members of different formats share it, e.g. a Q6_K v
    between Q4_K q|k and gate: all read Q8_K). Rows are independent, so every output has the
    bits of its own matrix's call. qmatvec_v3.Stack's interface (bounds, split)."""

    def __init__(self, groups: tuple[tuple[QWeight, int, int], ...], bounds: tuple[tuple[int, int], ...]):
        self.groups = groups  # (weight, n0, n1): one weight per run of one format, its output columns
        self.bounds = bounds  # [n0, n1) of each member
        self.n_out = bounds[-1][1]

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return [y[:, a:b] for a, b in self.bounds]


def fast_stack(ws: list[QWeight]) -> FastStack | None:
    """One FastStack over weights of one row length and one vec_dot_type (float formats: one
    format); None when they differ."""
    f0 = ws[0]
    kinds = {dot.VEC_DOT_TYPE.get(w.fmt) for w in ws}
    if any(w.n_in != f0.n_in for w in ws) or len(kinds) != 1 or None in kinds:
        return None
    if f0.fmt in FLOAT_FORMATS and any(w.fmt != f0.fmt for w in ws):
        return None
    runs: list[list[QWeight]] = []
    for w in ws:
        if runs and runs[-1][0].fmt == w.fmt:
            runs[-1].append(w)
        else:
            runs.append([w])
    n, bounds, groups = 0, [], []
    for run in runs:
        fields = {k: torch.cat([w.fields[k] for w in run], 0).contiguous() for k in run[0].fields}
        g0 = n
        for w in run:
            w.fields = {k: v[n - g0:n - g0 + w.n_out] for k, v in fields.items()}
            bounds.append((n, n + w.n_out))
            n += w.n_out
        groups.append((QWeight("+".join(w.name for w in run), run[0].fmt, n - g0, f0.n_in, fields), g0, n))
    return FastStack(tuple(groups), tuple(bounds))


def round_to_vec_dot(x: torch.Tensor, fmt: G) -> torch.Tensor:
    """x f32 rounded to a float weight's vec_dot_type (ggml_cpu_fp32_to_fp16 / _bf16: round to
    nearest even, as torch's casts), back in f32; f32 weights take x as is."""
    if fmt == G.F16:
        return x.to(torch.float16).to(torch.float32)
    if fmt == G.BF16:
        return x.to(torch.bfloat16).to(torch.float32)
    return x


def _sliced(matvec, x: torch.Tensor, n_out: int) -> torch.Tensor:
    """x [T, n_in] -> [T, n_out] by `matvec(x_slice, out_slice)` over slices of <= 16 rows (the
    fused matvec's row limit), each written into its rows of one output."""
    x = x.contiguous()
    T = x.shape[0]
    if T <= qmatvec.MAX_ROWS:
        return matvec(x, None)
    out = torch.empty((T, n_out), dtype=torch.float32, device=x.device)
    for t0 in range(0, T, qmatvec.MAX_ROWS):
        matvec(x[t0:t0 + qmatvec.MAX_ROWS], out[t0:t0 + qmatvec.MAX_ROWS])
    return out


class Linear:
    """y = x @ W^T for a QWeight, by lane and device. x: f32 [T, n_in] -> f32 [T, n_out]."""

    def __init__(self, lane: Lane, device: torch.device):
        self.lane = lane
        self.device = device
        self.cuda = device.type == "cuda"
        self.triton_rows = self.cuda  # the Triton matvec serves, in slices of <= 16 rows (CUDA)
        self._cache: dict = {}
        self._cached_bytes = 0
        self._act_memo: tuple | None = None  # (x, x._version, form, its activations): keep_act
        # the integer lane on CUDA: the tails that write a projection's input quantize it too
        # (act_out); configuration, not a per-call switch (tools/device_profile.py times the step
        # with it off: a quantize launch per projection input, the same bits)
        self.tail_acts = True
        # the fast lane's K-quant projections on CUDA: the int8 tile (kernels/qtile_i8.py), checked
        # bitwise against its reference on this device first (LaneError if it differs)
        self.tile_formats: tuple[G, ...] = ()
        if lane is Lane.FAST and self.cuda:
            from .kernels import qtile_i8

            if qtile_i8.available(device):
                qtile_i8.self_check(str(device))
                self.tile_formats = qtile_i8.FORMATS
                for fmt, config, split, group, stream in qtile_i8.ring_routes():  # the table's ring routes, each checked
                    qtile_i8.self_check_ring(str(device), fmt, config, split, group, stream)

    def stacked_ok(self, T: int, st=None) -> bool:
        """Stacked projections serve this call: on CUDA stacks of the split GEMM's layout
        (kernels/qgemm_split) and of the packed layout (kernels/qmatvec_v3.Stack: the matvec
        slices) every call; on the CPU (cpu_native.CpuStack) every call of the C GEMM; in the
        fast lane (FastStack) every call on both devices."""
        if self.lane is Lane.FAST:
            return True
        if self.cuda and st is not None and _is_split(getattr(st, "packed", None)):
            return True
        if self.lane is Lane.W4A4 and 1 < T <= qmatvec.MAX_ROWS:
            return False  # verify rows of the W4A4 lane: each projection by itself (__call__)
        return self.triton_rows or not self.cuda

    def stacked_raw(self, st, x: torch.Tensor) -> torch.Tensor:
        """x [T, n_in] -> [T, sum n_out] for a Stack (one launch / one GEMM)."""
        if isinstance(st, FastStack):
            return self._fast_stack(st, x)
        if not self.cuda:
            from .kernels import cpu_native

            if isinstance(st, cpu_native.CpuStack):
                return cpu_native.gemm(st.mat, x.contiguous())
        if _is_split(st.packed):
            from .kernels import qgemm_split

            return qgemm_split.matmul(st.packed, self.split_act(x))
        return _packed(st.packed, x)

    def stacked(self, st, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, n_in] -> the members' outputs of a Stack (column views of one [T, sum] result)."""
        return st.split(self.stacked_raw(st, x))

    def __call__(self, w: QWeight, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        if self.lane is Lane.FAST:
            if w.fmt in FLOAT_FORMATS:
                xr = round_to_vec_dot(x, w.fmt)
                if self.triton_rows:  # the fused matvec in <= 16-row slices at every T: one order per row
                    return torch.cat([qmatvec.matvec(w, xr[t0:t0 + qmatvec.MAX_ROWS].contiguous())
                                      for t0 in range(0, T, qmatvec.MAX_ROWS)])
                return self._exact(w, xr)
            if self.cuda:
                return self._i8(w, self.int_act(x, dot.VEC_DOT_TYPE[w.fmt]))
            return self._cpu_int(w, x)
        if self.lane is Lane.W4A4 and 1 < T <= qmatvec.MAX_ROWS and "isi" in w.fields:
            from .w4a4 import matmul_w4a4  # book 7.4.3: the verify forward of a W4A4 file

            return matmul_w4a4(w, x)
        return self._exact(w, x)

    def _fast_stack(self, st: FastStack, x: torch.Tensor) -> torch.Tensor:
        """x [T, n_in] -> [T, st.n_out]: each group into its columns; on CUDA x is quantized
        once for the stack (kernels/qmatmul_i8.quantize_act, then matmul_i8_act per group)."""
        if len(st.groups) == 1:
            return self(st.groups[0][0], x)
        out = torch.empty((x.shape[0], st.n_out), dtype=torch.float32, device=x.device)
        if self.cuda:
            act = self.int_act(x, dot.VEC_DOT_TYPE[st.groups[0][0].fmt])
            for w, a, b in st.groups:
                self._i8(w, act, out[:, a:b])
            return out
        for w, a, b in st.groups:
            out[:, a:b] = self(w, x)
        return out

    def _i8(self, w: QWeight, act, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fast lane's GEMM on CUDA (the SPEC of dot.matmul_ggml): K-quants where the int8 tile
        serves go where the tuning table routes their shape and row bucket (qtile_i8.route: the tile
        or its ring variant on a tiling), other integer formats (and devices without the tile)
        through kernels/qmatmul_i8. Every route has the same bits."""
        if w.fmt in self.tile_formats:
            from .kernels import qtile_i8

            return qtile_i8.matmul(w, act, out)
        from .kernels import qmatmul_i8

        return qmatmul_i8.matmul_i8_act(w, act, out)

    def _kept(self, x: torch.Tensor, key):
        """The activations kept for x under `key` (keep_act), or None: x must be the same tensor
        object, within one forward run, and (outside inference mode) unmodified since."""
        memo = self._act_memo
        version = None if x.is_inference() else x._version  # inference tensors keep no counter
        if memo is not None and memo[0] is x and memo[1] == version and memo[2] == key:
            return memo[3]
        return None

    def keep_act(self, x: torch.Tensor, act, key=None) -> None:
        """Keep `act`, the activations of x in form `key` (default act.kind, the vec_dot_type of a
        qmatmul_i8.Act; "split" for the split lane's), for the projections that read x next; None
        keeps nothing."""
        if act is not None:
            key = act.kind if key is None else key
            self._act_memo = (x, None if x.is_inference() else x._version, key, act)

    def split_act(self, x: torch.Tensor):
        """kernels/qgemm_split.split_act of x, formed once for the projections that read the same
        x (q|k|gate and v, ...)."""
        from .kernels import qgemm_split

        act = self._kept(x, "split")
        if act is None:
            act = qgemm_split.split_act(x.contiguous())
            self.keep_act(x, act, "split")
        return act

    def int_act(self, x: torch.Tensor, kind: G):
        """x in the integer lane's vec_dot_type `kind` on CUDA (kernels/qmatmul_i8.Act): what the
        kernel that wrote x quantized along with it (act_out), or a quantize launch now."""
        from .kernels import qmatmul_i8

        act = self._kept(x, kind)
        if act is None:
            act = qmatmul_i8.quantize_act(x.contiguous(), kind)
            self.keep_act(x, act)
        return act

    def act_out(self, consumer, rows: int, n_in: int):
        """An empty qmatmul_i8.Act of [rows, n_in] in the vec_dot_type the integer lane on CUDA
        converts the input of `consumer` (a QWeight or FastStack) to, for the kernel that writes
        that input to fill (kernels/fused.py, then keep_act); None where no conversion happens
        (other lanes, the CPU, float weights)."""
        if self.lane is not Lane.FAST or not self.cuda or not self.tail_acts or consumer is None:
            return None
        w = consumer.groups[0][0] if isinstance(consumer, FastStack) else consumer
        if w.fmt in FLOAT_FORMATS:
            return None
        from .kernels import qmatmul_i8

        return qmatmul_i8.Act.empty(dot.VEC_DOT_TYPE[w.fmt], rows, n_in, self.device)

    def forget_acts(self) -> None:
        """Drop the kept activations (Forward.run calls it first: x objects of one run only)."""
        self._act_memo = None

    def _exact(self, w: QWeight, x: torch.Tensor) -> torch.Tensor:
        """The exact lane's projection: f32 activations against the exact decode of `w`."""
        if self.cuda and _is_split(w.packed):  # every row count: one row-invariant family
            from .kernels import qgemm_split

            return qgemm_split.matmul(w.packed, self.split_act(x))
        if not self.triton_rows:
            return self._cpu_gemm(w, x.contiguous())
        if w.packed is not None and not _is_split(w.packed):  # qmatvec_v3's layout: matvec slices
            return _packed(w.packed, x)
        return _sliced(lambda xs, out: qmatvec.matvec(w, xs, out), x, w.n_out)

    def cpu_mat(self, w: QWeight):
        """The GEMM's form of `w` (cpu_native.CpuMat), cached; None past the byte budget."""
        from .kernels.cpu_native import CpuMat

        key = ("mat", id(w))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        size = CpuMat.resident_bytes(w)
        if self._cached_bytes + size > CPU_CACHE_BYTES:
            return None
        m = CpuMat.of(w)
        self._cache[key] = m
        self._cached_bytes += m.nbytes
        return m

    def _cpu_gemm(self, w: QWeight, x: torch.Tensor) -> torch.Tensor:
        """x f32 [T, n_in] -> [T, n_out] through the C GEMM; past the cache budget each call
        decodes row chunks (every output is still one whole-row dot in the fixed order)."""
        from .kernels import cpu_native

        m = self.cpu_mat(w)
        if m is not None:
            return cpu_native.gemm(m, x)
        out = torch.empty((x.shape[0], w.n_out), dtype=torch.float32)
        rows = max(1, CHUNK_BYTES // (4 * w.n_in))
        for n0 in range(0, w.n_out, rows):
            n1 = min(w.n_out, n0 + rows)
            part = cpu_native.CpuMat(cpu_native.FMT_F32, decode_range(w, n0, n1).contiguous(), None, n1 - n0, w.n_in)
            cpu_native.gemm(part, x, out=out[:, n0:n1])
        return out

    def int_codes(self, w: QWeight) -> dict | None:
        """dot.codes_from_fields of `w`, cached; None past the byte budget."""
        key = ("codes", id(w))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        size = dot.codes_nbytes(w.fmt, w.n_out, w.n_in)
        if self._cached_bytes + size > CPU_CACHE_BYTES:
            return None
        wc = dot.codes_from_fields(w.fmt, {k: v.numpy() for k, v in w.fields.items()}, w.n_in)
        self._cache[key] = wc
        self._cached_bytes += size
        return wc

    def i8_codes(self, w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
        """cpu_native.i8_codes of a Q8_0/Q4_0 weight, cached within the byte budget (Q8_0: its own
        qs, no copy; the scales as f32)."""
        from .kernels import cpu_native

        key = ("i8", id(w))
        hit = self._cache.get(key)
        if hit is None:
            hit = cpu_native.i8_codes(w.fmt, w.fields["qs"], w.fields["d"])
            size = hit[1].numel() * 4 + (hit[0].numel() if w.fmt != G.Q8_0 else 0)
            if self._cached_bytes + size <= CPU_CACHE_BYTES:  # past the budget: formed per call
                self._cache[key] = hit
                self._cached_bytes += size
        return hit

    def _cpu_int(self, w: QWeight, x: torch.Tensor) -> torch.Tensor:
        """The integer lane on the CPU: x f32 [T, n_in] -> [T, n_out], matmul_ggml's bits. Q8_0 and
        Q4_0 weights through the C kernel (cpu.c mu_gemm_i8); the other formats through dot.py's
        matmul_codes, past the cache budget building the codes of row chunks (rows are independent)."""
        from .kernels import cpu_native

        if w.fmt in cpu_native.I8_FORMATS:
            wq, wd = self.i8_codes(w)
            return cpu_native.gemm_i8(wq, wd, x.contiguous())
        xn = x.detach().contiguous().numpy()
        wc = self.int_codes(w)
        if wc is not None:
            return torch.from_numpy(dot.matmul_codes(wc, w.fmt, xn))
        out = np.empty((x.shape[0], w.n_out), dtype=np.float32)
        rows = max(1, CHUNK_BYTES // (4 * w.n_in))
        for n0 in range(0, w.n_out, rows):
            n1 = min(w.n_out, n0 + rows)
            part = dot.codes_from_fields(w.fmt, {k: v[n0:n1].numpy() for k, v in w.fields.items()}, w.n_in)
            out[:, n0:n1] = dot.matmul_codes(part, w.fmt, xn)
        return torch.from_numpy(out)


def _packed(p, x: torch.Tensor) -> torch.Tensor:
    """x [T, n_in] -> [T, n_out] over a qmatvec_v3 layout (a weight's or a stack's): the fused
    matvec in slices of <= 16 rows at every row count, so a row has the bits it has alone."""
    from .kernels import qmatvec_v3

    return _sliced(lambda xs, out: qmatvec_v3.matvec_v3(p, xs, out), x, p.n_out)


def _is_split(packed) -> bool:
    """The weight or stack carries the split GEMM's layout (kernels/qgemm_split)."""
    if packed is None:
        return False
    from .kernels.qgemm_split import SplitPacked

    return isinstance(packed, SplitPacked)


def decode_range(w: QWeight, n0: int, n1: int) -> torch.Tensor:
    """Decode rows [n0, n1) through row views of the fields (no gather copy)."""
    from .weights import decode_fields

    if not w.fields and w.packed is not None:  # only the decode kernel's layout is resident
        from .kernels.qmatvec_v3 import decode_rows

        return decode_rows(w.packed, None, n0, n1)
    return decode_fields(w.fmt, {k: v[n0:n1] for k, v in w.fields.items()}, w.n_in)
