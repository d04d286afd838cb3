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
