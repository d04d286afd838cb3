"""`muser generate --draft/--no-draft/--verify-len` and `muser inspect` of a drafter."""

from __future__ import annotations

import json

from muser.cli import main


def _json_run(capsys, argv):
    rc = main(argv)
    assert rc == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def test_generate_draft_flags(spec_target, make_drafter, capsys):
    d = make_drafter(spec_target)
    base = ["generate", "--model", str(spec_target), "--prompt", "def f(x):", "--max-tokens", "24",
            "--temperature", "0", "--json"]
    plain = _json_run(capsys, base + ["--no-draft"])
    spec = _json_run(capsys, base + ["--draft", str(d), "--verify-len", "3"])
    assert plain["spec"] is None
    assert spec["ids"] == plain["ids"]
    st = spec["spec"]
    assert st["verify_len"] == 3 and st["proposals"] > 0 and st["draft_sliding_window"] == 2048
    assert set(st) >= {"proposals", "accepted", "mean_accepted_length", "gate_transitions", "acceptance_rate"}


def test_generate_bad_verify_len_is_refused(spec_target, make_drafter, capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["generate", "--model", str(spec_target), "--draft", str(make_drafter(spec_target)), "--verify-len", "5"])


def test_inspect_drafter(spec_target, make_drafter, capsys):
    d = make_drafter(spec_target)
    assert main(["inspect", str(d), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "valid drafter" and out["drafter"]["target_layers"] == [1, 3]
    assert out["context_rows_max"] == 64 + 2048 and out["shares_target"] == {"embedding": True, "lm_head": True}
    assert main(["inspect", str(d)]) == 0
    assert "DFlash drafter" in capsys.readouterr().out
