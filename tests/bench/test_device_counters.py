"""The hardware-counter stage's own logic (tools/device_counters.py): ncu's raw CSV read into
records in launch order, and bad arguments refused before any work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "device_counters", Path(__file__).resolve().parents[2] / "tools" / "device_counters.py")
assert _spec is not None and _spec.loader is not None
dc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dc)

T = "gpu__time_duration.sum"
R = "launch__registers_per_thread"
S = "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"


def test_raw_csv_becomes_records_in_launch_order():
    raw = ("==PROF== Connected to process 1\nprogram output\n"
           f'"ID","Kernel Name","{T}","{R}","{S}","not.asked"\n'
           '"","","nsecond","register/thread","",""\n'
           f'"0","_matvec_v3_kernel","74,464","243","2.13","x"\n'
           f'"1","_act_prep_kernel","3,904","32","13.47","y"\n')
    recs = dc.parse_records(raw)
    assert [r["kernel"] for r in recs] == ["_matvec_v3_kernel", "_act_prep_kernel"]
    assert recs[0]["metrics"] == {T: 74464.0, R: 243.0, S: 2.13}  # thousands separators read, others left out
    assert dc.parse_records("==PROF== no kernels profiled\n") == []


@pytest.mark.parametrize("argv,needle", [
    (["out", "--shape", "Q8_0:64:256"], "Q8_0:64:256"),
    (["out", "--shape", "Q4_K:64:100"], "multiple of 256"),
    (["out", "--shape", "Q4_K:64"], "Q4_K:64"),
    (["out", "--shape", "Q4_K:64:256,Q6_K:64:100"], "'Q6_K:64:100'"),  # a list: the bad one named
    (["out", "--lanes", "exact,split"], "'split'"),
    (["out", "--rows", "1,17"], "'17'"),
])
def test_bad_arguments_are_refused_naming_the_value(argv, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        dc.main([str(tmp_path / a) if a == "out" else a for a in argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written
