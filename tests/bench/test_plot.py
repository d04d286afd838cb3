"""PNG plots drawn from the repository's own receipts (serve, handoff, kvpack, decode, prefill),
through `muser bench plot`, and the refusals before anything is written."""

from __future__ import annotations

import json

import pytest

from muser.bench import plot as P
from muser.bench.receipt import REPO_RECEIPTS
from muser.cli import main
from muser.errors import PlotError

MAX_PNG = 200 * 1024


def _latest(kind: str, n: int = 1) -> list[str]:
    files = sorted(REPO_RECEIPTS.glob(f"*-{kind}.json"))
    assert len(files) >= n, f"bench/receipts holds {len(files)} {kind} receipts"
    return [str(f) for f in files[-n:]]


def _png(path) -> bytes:
    data = path.read_bytes()
    assert data[:8] == P.PNG_MAGIC, path
    assert 10_000 < len(data) < MAX_PNG, (path, len(data))
    return data


@pytest.mark.parametrize("receipts", [
    pytest.param(lambda: _latest("serve"), id="serve"),
    pytest.param(lambda: _latest("handoff", 2), id="handoff-two-receipts"),
    pytest.param(lambda: _latest("kvpack"), id="kvpack"),
    pytest.param(lambda: _latest("decode") + _latest("prefill"), id="decode-and-prefill"),
])
def test_a_plot_is_written_from_real_receipts(receipts, tmp_path, capsys):
    out = tmp_path / "p.png"
    assert main(["bench", "plot", *receipts(), "--out", str(out)]) == 0
    _png(out)
    assert str(out) in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]  # no temporary file left


def test_serve_plot_draws_one_line_set_per_server(tmp_path):
    """A receipt with the comparator's results carries both engines: every server in results
    gets its p50 and p99 lines and its throughput line."""
    with_both = [p for p in sorted(REPO_RECEIPTS.glob("*-serve.json")) if "llama-server" in P.load_receipt(p)["results"]]
    assert with_both, "no serve receipt ran the comparator"
    body = P.load_receipt(with_both[-1])  # the latest serve receipt that ran llama-server beside Muser
    fig = P.plot_serve(P.pyplot(), [body])
    try:
        labels = [[line.get_label() for line in ax.get_lines()] for ax in fig.axes]
    finally:
        P.pyplot().close(fig)
    servers = list(body["results"])
    assert servers == ["muser", "llama-server"]
    assert labels[0] == [f"{s} {q}" for s in servers for q in ("p50", "p99")]
    assert labels[2] == servers


def test_refusals_name_the_value_and_write_nothing(tmp_path):
    out = tmp_path / "p.png"
    mixed = _latest("kvpack") + _latest("serve")
    with pytest.raises(PlotError, match="different families"):
        P.plot_receipts(mixed, out)
    with pytest.raises(PlotError, match="kind 'ppl'"):
        P.plot_receipts(_latest("ppl"), out)
    with pytest.raises(PlotError, match=r"must end in \.png"):
        P.plot_receipts(_latest("kvpack"), tmp_path / "p.jpg")
    with pytest.raises(PlotError, match="does not exist"):
        P.plot_receipts(_latest("kvpack"), tmp_path / "no" / "p.png")
    body = json.loads(open(_latest("kvpack")[0]).read())
    del body["results"]["lengths"][next(iter(body["results"]["lengths"]))]["ttft_warm_mean_s"]
    broken = tmp_path / "broken-kvpack.json"
    broken.write_text(json.dumps(body))
    with pytest.raises(PlotError, match=r"broken-kvpack\.json.*lacks results\.lengths\.\d+\.ttft_warm_mean_s"):
        P.plot_receipts([str(broken)], out)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["broken-kvpack.json"]
    assert P.pyplot().get_fignums() == []  # the half-drawn figure was closed
    assert main(["bench", "plot", str(tmp_path / "missing.json"), "--out", str(out)]) == 2


def test_missing_matplotlib_is_refused_before_work(monkeypatch, tmp_path):
    import argparse
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(PlotError, match=r"muser\[bench\]"):
        P.check_plot_flag(argparse.Namespace(plot=""))
    P.check_plot_flag(argparse.Namespace(plot=None))  # no --plot: no matplotlib needed
