"""Round-trip quality per format on Gaussian and heavy-tailed (Student-t, 3 dof) data:
relative RMSE (RMS error / std) within bounds set ~25% above the measured values, and the
expected ordering by bits per weight."""

from __future__ import annotations

import pytest

from muser.quant.quality import FORMATS, bits_per_weight, relative_rmse, sample_data as data

# measured (64 x 4096, seed 0): gaussian / student_t3 = 0.00021/0.00021 (f16), 0.00166/0.00166 (bf16),
# 0.00536/0.00839 (q8_0), 0.01778/0.02547 (q6_k), 0.03619/0.04716 (q5_k), 0.07147/0.09320 (q4_k),
# 0.08611/0.12878 (q4_0), 0.09519/0.09079 (nvfp4), 0.10337/0.09342 (nvfp4-ggml)
BOUNDS = {
    "f16": (0.00026, 0.00026),
    "bf16": (0.0021, 0.0021),
    "q8_0": (0.0067, 0.0107),
    "q6_k": (0.0222, 0.0323),
    "q5_k": (0.0451, 0.0589),
    "q4_k": (0.0891, 0.1154),
    "q4_0": (0.1075, 0.1586),
    "nvfp4": (0.1188, 0.1124),
    "nvfp4-ggml": (0.1289, 0.1157),
}


@pytest.fixture(scope="module")
def table():
    xs = {k: data(k, 64, 4096) for k in ("gaussian", "student_t3")}
    return {f: tuple(relative_rmse(f, xs[k]) for k in ("gaussian", "student_t3")) for f in FORMATS}


def test_rmse_bounds(table):
    for f, (g, t) in table.items():
        bg, bt = BOUNDS[f]
        assert 0 < g <= bg and 0 < t <= bt, (f, g, t)


def test_more_bits_less_error(table):
    order = ["f16", "bf16", "q8_0", "q6_k", "q5_k", "q4_k"]
    for a, b in zip(order, order[1:]):
        assert table[a][0] < table[b][0] and table[a][1] < table[b][1], (a, b)
        assert bits_per_weight(a) >= bits_per_weight(b)
    # at 4.5 bits, the float grid wins on heavy tails, the integer K-quant on Gaussian data
    assert table["q4_k"][0] < table["nvfp4"][0] and table["nvfp4"][1] < table["q4_k"][1]
    assert table["q4_k"][0] < table["q4_0"][0]  # same 4.5 bits, min+offset and 6-bit sub-scales win
