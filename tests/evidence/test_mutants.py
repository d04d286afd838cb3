"""The gates must see the bugs they exist for. Each planted bug (a small realistic slip) is applied
to a scratch copy of src/ in a temporary folder, and the test that guards it runs in a subprocess
with PYTHONPATH at that copy: it must turn red (pytest exit status 1, tests failed). A gate that
went blind would let its mutant pass, and this test fails instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.comparator  # the guarding tests compare against the pinned llama.cpp

REPO = Path(__file__).resolve().parents[2]
SAMPLER = "tests/sample/test_sampler_boundaries.py"
PPL = "tests/micro/test_ppl_parity.py::test_ppl_gate_per_position_short"
ROUNDING = "tests/oracle/test_rounding_points.py"
GATE1 = "tests/oracle/test_gate1.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under src/muser/
    old: str
    new: str
    target: str  # the test (file or node) that must turn red
    select: str = ""  # pytest -k expression within the target
    expect: str = "AssertionError"  # what the red run must show (its own check failing, not an error)


MUTANTS = [
    Mutant("top_p >= becomes >", "sample/chain.py", "    ok = cum >= p\n", "    ok = cum > p\n", SAMPLER, "top_p"),
    Mutant("min_p >= becomes >", "sample/chain.py", "c.logit >= F32(max_logit + lp)", "c.logit > F32(max_logit + lp)",
           SAMPLER, "min_p and unsorted"),
    Mutant("min_p sorted path < becomes <=", "sample/chain.py", "stop = c.logit < min_logit",
           "stop = c.logit <= min_logit", SAMPLER, "min_p and sorted_path"),
    Mutant("typical > becomes >=", "sample/chain.py", "    ok = cum > p\n", "    ok = cum >= p\n", SAMPLER, "typical"),
    Mutant("dist searchsorted side left becomes right", "sample/chain.py", 'side="left"', 'side="right"',
           SAMPLER, "dist"),
    Mutant("top_p min_keep off by one", "sample/chain.py", "lo = max(0, min_keep - 1 - offset)",
           "lo = max(0, min_keep - offset)", SAMPLER, "top_p_min_keep"),
    Mutant("typical min_keep off by one", "sample/chain.py", "ok[: min_keep - 1] = False", "ok[: min_keep] = False",
           SAMPLER, "typical_min_keep"),
    Mutant("min_p min_keep off by one", "sample/chain.py", "stop[: max(1, min_keep)] = False",
           "stop[: max(1, min_keep - 1)] = False", SAMPLER, "min_p_min_keep"),
    Mutant("softcap 30 instead of the file's 20", "oracle/numerics.py", "    y = logits * F32(logit_scale)\n",
           "    y = logits * F32(logit_scale)\n    softcap = 30.0 if softcap else softcap\n", PPL,
           expect="g[\"ppl_ok\"]"),  # on the shipped model the perplexity itself moves by ~3%
    # on the trained micro model every norm input is far above sqrt(eps), so eps x 0.1 stays inside
    # the perplexity gate's 1-ulp floor there; the rounding fixture's sub-layers sit near it
    Mutant("RMSNorm eps x 0.1", "oracle/numerics.py", "np.sqrt(mean + F32(eps))", "np.sqrt(mean + F32(eps * 0.1))",
           GATE1, "test_gate_1a and rounding"),
    Mutant("FFN input rounding point dropped", "oracle/forward.py",
           "up, gt = self._mm(h, lw.ffn_up, lw.ffn_gate)",
           "up, gt = nm.matmul(h, lw.ffn_up.w), nm.matmul(h, lw.ffn_gate.w)", ROUNDING, "ffn_in",
           expect="Gate 1b passes on this fixture"),
    Mutant("FFN down rounding point dropped", "oracle/forward.py", "(d,) = self._mm(f, lw.ffn_down)",
           "d = nm.matmul(f, lw.ffn_down.w)", ROUNDING, "ffn_down", expect="Gate 1b passes on this fixture"),
]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A copy of src/ beside links to the rest of the repository (tools/, models/, ...), so the
    copy's REPO_ROOT-relative paths resolve as in the real tree."""
    root = tmp_path_factory.mktemp("mutant-src")
    shutil.copytree(REPO / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for entry in REPO.iterdir():
        if entry.name not in ("src", ".git"):
            (root / entry.name).symlink_to(entry)
    return root / "src"


def _run(src: Path, args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_scratch_copy_is_what_runs(scratch):
    r = _run(scratch, ["-c", "import muser; print(muser.__file__)"])
    assert r.returncode == 0 and r.stdout.strip().startswith(str(scratch)), r.stdout + r.stderr


def test_every_mutant_applies_exactly_once():
    for m in MUTANTS:
        text = (REPO / "src" / "muser" / m.file).read_text()
        assert text.count(m.old) == 1, (m.name, text.count(m.old))


@pytest.mark.parametrize("m", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_turns_its_gate_red(scratch, m):
    path = scratch / "muser" / m.file
    pristine = path.read_text()
    assert pristine.count(m.old) == 1, m.name
    path.write_text(pristine.replace(m.old, m.new))
    try:
        args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", m.target]
        if m.select:
            args += ["-k", m.select]
        r = _run(scratch, args)
    finally:
        path.write_text(pristine)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 1 and " failed" in r.stdout, f"{m.name}: {m.target} stayed green (rc {r.returncode})\n{tail}"
    assert m.expect in r.stdout, f"{m.name}: {m.target} went red, but not on its check ({m.expect!r})\n{tail}"
