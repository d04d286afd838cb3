"""The random stream of llama.cpp's `dist` sampler, bit for bit (book 8.6 / ch. 21: source-pinned
MT19937, kept apart from any other generator).

* std::mt19937 seeded with a 32-bit seed (init_genrand: x[i] = 1812433253 * (x[i-1] ^ x[i-1] >> 30) + i).
* std::uniform_real_distribution<double>(0, 1) in libstdc++ = std::generate_canonical<double, 53>:
  two 32-bit draws x1, x2; sum = x1 + x2 * 2^32 rounded to double; u = sum / 2^64; u >= 1 becomes
  the largest double below 1.

CPython's `random.Random` runs the same MT19937 core (tempering included), so the state computed
by init_genrand is installed into one and 32-bit outputs are read with getrandbits(32).
"""

from __future__ import annotations

import random

_N = 624
_TWO32 = 4294967296.0
_TWO64 = 18446744073709551616.0
_BELOW_ONE = 1.0 - 2.0**-53  # std::nextafter(1.0, 0.0)


def init_genrand(seed: int) -> list[int]:
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, _N):
        prev = mt[-1]
        mt.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return mt


class MT19937:
    """std::mt19937 with libstdc++'s uniform_real_distribution<double>(0, 1)."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 32:
            raise ValueError(f"seed must be a 32-bit unsigned integer, got {seed!r}")
        self.seed = seed
        self._r = random.Random()
        self._r.setstate((3, tuple(init_genrand(seed)) + (_N,), None))

    def next_u32(self) -> int:
        return self._r.getrandbits(32)

    def uniform(self) -> float:
        """One std::uniform_real_distribution<double>(0.0, 1.0) draw (two 32-bit outputs)."""
        x1 = self._r.getrandbits(32)
        x2 = self._r.getrandbits(32)
        u = (float(x1) + float(x2) * _TWO32) / _TWO64
        return _BELOW_ONE if u >= 1.0 else u

    def getstate(self) -> tuple:
        return self._r.getstate()

    def setstate(self, state: tuple) -> None:
        self._r.setstate(state)
