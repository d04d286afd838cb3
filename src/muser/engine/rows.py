"""Next-token logits kept on the device (CUDA), read back only as far as the sampler needs.

    row = session.decode_row(token)      # DeviceRow on CUDA (np.ndarray on the CPU)
    packed = f(row.logits)               # any reduction on the device (muser.sample.candidates)
    host = row.read(packed)              # one copy back, with the row's finiteness flag
    full = row.host()                    # or the whole row, float32 [vocab]

A row is its own copy of the logits (a captured graph's output buffer is reused by the next
replay). Its finiteness is computed on the device with the row and read with the first
readback: a non-finite row then rolls the session's KV back to where it was before the call and
raises NonFiniteLogits (book 10.9: no distribution is installed), as the host path does at the
call itself.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..errors import NonFiniteLogits


class DeviceRow:
    def __init__(self, logits: torch.Tensor, finite: torch.Tensor | None,
                 on_non_finite: Callable[[np.ndarray], NonFiniteLogits] | None = None):
        self.logits = logits  # f32 [vocab] on the device, this row's own storage
        self._finite = finite  # bool [] on the device, not read yet; None: known finite
        self._fail = on_non_finite  # rolls the KV back and names the offending value
        self._host: np.ndarray | None = None

    @property
    def vocab(self) -> int:
        return int(self.logits.shape[0])

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def _raise(self, host: np.ndarray) -> None:
        self._finite = None
        fail, self._fail = self._fail, None
        if fail is None:
            raise NonFiniteLogits("non-finite logits: no distribution installed (book 10.9)")
        raise fail(host)

    def read(self, packed: torch.Tensor) -> np.ndarray:
        """`packed` (float64 [n], computed on the device from `logits`) on the host, in one
        copy together with the finiteness flag while that is unread."""
        if self._finite is None:
            return packed.to("cpu").numpy()
        out = torch.cat([self._finite.to(packed.dtype).view(1), packed]).to("cpu").numpy()
        if out[0] != 1:
            self._raise(self.logits.to("cpu").numpy())
        self._finite = None
        return out[1:]

    def host(self) -> np.ndarray:
        """The whole row, float32 [vocab] on the host (read once)."""
        if self._host is None:
            h = self.logits.to("cpu", torch.float32).numpy()
            if self._finite is not None and not np.isfinite(h).all():
                self._raise(h)
            self._finite = None
            self._host = h
        return self._host


__all__ = ["DeviceRow"]
