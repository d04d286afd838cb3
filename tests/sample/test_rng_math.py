"""The pieces under the sampler: MT19937 + generate_canonical, libm expf/logf, libstdc++ sorts."""

from __future__ import annotations

import random
import shutil
import subprocess
import textwrap

import numpy as np
import pytest

from muser.sample import libm
from muser.sample.mt19937 import MT19937
from muser.text import stl


def test_mt19937_known_answer():
    m = MT19937(5489)  # the C++ standard: the 10000th output of default-seeded mt19937
    for _ in range(9999):
        m.next_u32()
    assert m.next_u32() == 4123659995


def test_uniform_is_generate_canonical():
    a, b = MT19937(42), MT19937(42)
    for _ in range(1000):
        x1, x2 = b.next_u32(), b.next_u32()
        u = (float(x1) + float(x2) * 4294967296.0) / 18446744073709551616.0
        assert a.uniform() == (u if u < 1.0 else 1.0 - 2.0**-53)
    with pytest.raises(ValueError):
        MT19937(1 << 32)


def test_state_round_trip():
    a = MT19937(7)
    a.uniform()
    st = a.getstate()
    x = [a.uniform() for _ in range(5)]
    a.setstate(st)
    assert [a.uniform() for _ in range(5)] == x


def test_expf_is_libm_expf():
    rng = np.random.default_rng(0)
    x = np.concatenate([(rng.standard_normal(300_000) * 6).astype(np.float32) - 4,
                        np.array([0.0, -0.0, -np.inf, -87.5, -103.9, -104.5, -1e-45, 88.5], np.float32)])
    f = libm._libm().expf
    ref = np.array([f(float(v)) for v in x], dtype=np.float32)
    assert np.array_equal(libm.expf(x).view(np.uint32), ref.view(np.uint32))


# Inputs where float64 exp rounded to float32 is not glibc's expf: of all such float32 in [-87, 88],
# those farthest from a rounding midpoint (0.00164 ulp), which libm.expf must send to libm.
_EXPF_HARD = np.array([
    0x40B11961, 0x419B2594, 0x427C4729, 0xBBD99546, 0xBBDB8410, 0xBBDC3DCE, 0xBBDD4EA3, 0xBBDE8BC7,
    0xBBDEEAEC, 0xBBE06681, 0xBBE0CFB9, 0xBBE1DB0E, 0xBBE20FEB, 0xBBE2883F, 0xBBE34C19, 0xBBE38D0C,
    0xBBE3E62A, 0xBBE4D655, 0xBBE6026D, 0xBBE65A0A, 0xBBE67942, 0xBBE72272, 0xBBE7328F, 0xBBE7AF70,
    0xBBE8785B, 0xBBE93CBF, 0xBBE983C0, 0xBBE9B397, 0xBBE9F610, 0xBBEB5613, 0xBBEBF4B6, 0xBBEC4CD8,
    0xBBED5845, 0xBBEDD52C, 0xBC6CB481, 0xBC6F4B50, 0xBC6F9EC6, 0xBC707F4A, 0xBC70A558, 0xBC70DA5E,
    0xBC714C07, 0xBC71E68A, 0xBC72C716, 0xBC74133C, 0xBF334828, 0xBFB25E7F, 0xC1DDDD7B, 0xC24FF943,
], dtype=np.uint32).view(np.float32)


def test_expf_near_rounding_midpoints():
    x = np.concatenate([np.linspace(-30, 5, 3000, dtype=np.float32), _EXPF_HARD])
    f = libm._libm().expf
    ref = np.array([f(float(v)) for v in x], dtype=np.float32)
    assert np.array_equal(libm.expf(x).view(np.uint32), ref.view(np.uint32))

def test_logf_is_libm_logf():
    x = np.random.default_rng(1).random(2000).astype(np.float32)
    f = libm._libm().logf
    assert np.array_equal(libm.logf(x), np.array([f(float(v)) for v in x], dtype=np.float32))


_HARNESS = textwrap.dedent("""
    #include <algorithm>
    #include <cstdio>
    #include <cstdlib>
    #include <vector>
    int main(int argc, char ** argv) {
        int mode = atoi(argv[1]), n = atoi(argv[2]), k = atoi(argv[3]);
        std::vector<std::pair<int, int>> v(n);
        for (int i = 0; i < n; i++) { int x; if (scanf("%d", &x) != 1) return 1; v[i] = {x, i}; }
        auto comp = [](const std::pair<int, int> & a, const std::pair<int, int> & b) { return a.first > b.first; };
        if (mode == 0) std::sort(v.begin(), v.end(), comp);
        else std::partial_sort(v.begin(), v.begin() + k, v.end(), comp);
        for (int i = 0; i < (mode == 0 ? n : k); i++) printf("%d ", v[i].second);
        return 0;
    }
""")


def test_stl_sorts_match_libstdcxx(tmp_path):
    """The tie order of std::sort / std::partial_sort, against the system libstdc++ (the one the
    comparator is built with; g++ is part of the comparator's toolchain)."""
    gxx = shutil.which("g++")
    assert gxx, "g++ (needed to build the comparator) is not on PATH"
    src = tmp_path / "t.cpp"
    src.write_text(_HARNESS)
    exe = tmp_path / "t"
    subprocess.run([gxx, "-O2", "-o", str(exe), str(src)], check=True)
    rng = random.Random(5)
    for mode in (0, 1):
        for n in (1, 2, 5, 16, 17, 33, 100, 700, 3000):
            for m in (2, 3, 50):
                vals = [rng.randrange(m) for _ in range(n)]
                k = max(1, n // 3)
                out = subprocess.run([str(exe), str(mode), str(n), str(k)], input=" ".join(map(str, vals)),
                                     capture_output=True, text=True, check=True).stdout.split()
                a = list(range(n))
                comp = lambda x, y: vals[x] > vals[y]  # noqa: E731
                if mode == 0:
                    stl.sort(a, 0, n, comp)
                else:
                    stl.partial_sort(a, 0, k, n, comp)
                    a = a[:k]
                assert [int(x) for x in out] == a, (mode, n, m)
