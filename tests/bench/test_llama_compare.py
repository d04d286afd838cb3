"""The llama.cpp comparators of `muser bench spec` and `muser bench serve`, at the parse level: the
pinned binaries' real output (recorded from the CPU build of the pinned sources on the 12.6M micro
pair shipped before the 22.4M one: a llama-speculative-simple draft-dflash run, a llama-server
start-up log and its streamed /v1/completions, and Muser's stream of the same request) is read into
the figures the receipts carry; the receipts they make verify; bad comparator flags are refused
before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muser.bench import llamabin as LB
from muser.bench.kinds import serve as S
from muser.bench.kinds import spec as K
from muser.bench.receipt import verify_receipt, write_receipt
from muser.cli import main
from muser.errors import ComparatorError

DATA = Path(__file__).parent / "data"
# the prompt of the recorded llama-speculative-simple run (-p, --no-escape)
PROMPT = "import os\nimport sys\n\ndef main(argv):\n    parser = "


def recorded_spec() -> tuple[str, str]:
    return (DATA / "llama-spec-greedy.stdout").read_text(), (DATA / "llama-spec-greedy.stderr").read_text()


def test_speculative_figures_from_the_recorded_run():
    out, err = recorded_spec()
    r = LB.parse_speculative(out, err, PROMPT)
    # llama.cpp read the shipped drafter as the DFlash it is (block 16, mask <|mask|> = 3, 3 layers)
    assert r["drafter"] == {"block_size": 16, "mask_token_id": 3, "n_extract": 3, "n_max": 7, "n_min": 0,
                            "p_min": 0.0}
    assert (r["n_draft"], r["n_predict"], r["n_drafted"], r["n_accept"]) == (7, 34, 133, 13)
    assert (r["rounds"], r["proposals"], r["accepted"], r["gen_drafts"], r["acc_drafts"]) == (21, 133, 13, 21, 10)
    assert r["acceptance_rate"] == pytest.approx(13 / 133)
    assert r["mean_accepted_length"] == pytest.approx(13 / 21)
    assert r["llama_mean_acc_len"] == pytest.approx(1 + 13 / 21, abs=5e-3)  # its own figure counts the bonus
    assert (r["prompt_eval_tokens"], r["tokens"]) == (16, 34)
    assert r["prompt_eval_s"] == pytest.approx(0.100) and r["decode_s"] == pytest.approx(0.638)
    assert r["checkpoints"] is False and r["n_max_clamped"] is False
    assert r["text"].startswith("1\n    parser = 2\n    parser.add_argument(") and not r["text"].endswith("\n\n")


@pytest.mark.parametrize("drop, needs", [
    ("statistics     draft-dflash", "statistics"),
    ("adding speculative implementation", "speculative implementations"),
    ("decoded ", "encode/decode"),
    ("n_accept  =", "n_accept"),
    ("- block_size=", "block/limits"),
])
def test_a_missing_figure_is_an_error(drop, needs):
    out, err = recorded_spec()
    cut = "\n".join(ln for ln in err.splitlines() if drop not in ln)
    assert cut != err
    with pytest.raises(ComparatorError, match=needs):
        LB.parse_speculative(out, cut, PROMPT)


def test_the_continuation_follows_the_echoed_prompt():
    out, _ = recorded_spec()
    with pytest.raises(ComparatorError, match="echo"):
        LB.generated_text(out, PROMPT + "never printed")


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_speculative_argv_spells_out_the_run():
    prompt = 'x = "a\\nb"\n'  # Python source: the backslash is text, not an escape
    greedy = LB.speculative_argv(Path("/b/llama-speculative-simple"), "t.gguf", "d.gguf", prompt, 128, 7, 512, 1,
                                 LB.SpecSampling(temperature=0.0))
    i = greedy.index("-p")
    assert greedy[i + 1] == prompt and "--no-escape" in greedy
    want = {"--spec-type": "draft-dflash", "-md": "d.gguf", "-m": "t.gguf", "--spec-draft-n-max": "7",
            "--spec-draft-p-min": "0", "-n": "128", "-c": "512", "-t": "1", "-tb": "1", "-lv": "4", "-fa": "off",
            "--temp": "0", "-ctk": "f16", "-ctv": "f16"}
    assert {k: value(greedy, k) for k in want} == want and "--top-k" not in greedy
    sampled = LB.speculative_argv(Path("/b/x"), "t", "d", prompt, 8, 3, 256, 2,
                                  LB.SpecSampling(**{k: v for k, v in K.MODES["t0.7"].items()}))
    want = {"--temp": "0.7", "--top-k": "40", "--top-p": "0.95", "--min-p": "0.05", "--seed": "20261201"}
    assert {k: value(sampled, k) for k in want} == want


def spec_rows() -> list[dict]:
    """Rows as the kind makes them: Muser's counters beside the recorded llama.cpp run."""
    out, err = recorded_spec()
    ll = LB.parse_speculative(out, err, PROMPT)
    side = {"proposals": ll["proposals"], "accepted": ll["accepted"], "rounds": ll["rounds"], "tokens": ll["tokens"],
            "wall_s": ll["prompt_eval_s"] + ll["decode_s"]}
    rows = []
    for cls, mode, open_acc in (("natural", "greedy", 14), ("natural-mid", "greedy", 13), ("synthetic", "greedy", 9)):
        rows.append({"class": cls, "mode": mode, "prompt": "p",
                     "muser": {"proposals": 70, "accepted": 8, "rounds": 10, "tokens": 32, "wall_s": 0.5},
                     "muser_gate_open": {"proposals": 133, "accepted": open_acc, "rounds": 21, "tokens": 32,
                                         "wall_s": 0.8},
                     "llama.cpp": side})
    return rows


def test_comparison_per_class_and_its_receipt(tmp_path):
    rows = spec_rows()
    c = K.compare(rows)
    assert set(c) == {"natural/greedy", "natural-mid/greedy", "synthetic/greedy"}
    nat, mid, syn = c["natural/greedy"], c["natural-mid/greedy"], c["synthetic/greedy"]
    assert nat["llama.cpp"]["acceptance_rate"] == pytest.approx(13 / 133)
    assert nat["muser_gate_open"]["mean_accepted_length"] == pytest.approx(14 / 21)
    assert nat["muser"]["tok_s"] == pytest.approx(64.0) and nat["llama.cpp"]["tok_s"] == pytest.approx(34 / 0.738)
    # acceptance like for like (gate held open), tok/s product against product (gated)
    assert nat["muser_ge_llama_cpp"] == {"acceptance_rate": True, "mean_accepted_length": True, "tok_s": True}
    assert syn["muser_ge_llama_cpp"] == {"acceptance_rate": False, "mean_accepted_length": False, "tok_s": True}
    # natural-mid is compared as its own class; equal to llama.cpp (13 of 133 in 21 rounds) counts as >=
    assert mid["muser_ge_llama_cpp"] == {"acceptance_rate": True, "mean_accepted_length": True, "tok_s": True}
    p = write_receipt("spec", model={"path": "t.gguf"}, device={"kind": "cpu"}, lane="exact",
                      gate={"status": "pass", "rule": "identical", "cases": 3, "identical_cases": 3},
                      results={"rows": rows, "comparison": c}, out_dir=tmp_path)
    assert verify_receipt(p) == []
    assert json.loads(p.read_text())["results"]["comparison"]["synthetic/greedy"]["muser_ge_llama_cpp"]["tok_s"]


def sse(name: str) -> list[tuple[float, str]]:
    """The recorded stream with arrival times 0.1 s apart, from t = 1.0."""
    lines = (DATA / name).read_text().splitlines()
    return [(1.0 + 0.1 * i, ln) for i, ln in enumerate(lines)]


def test_both_servers_streams_read_alike():
    m = S.read_stream(0.5, sse("muser-serve-completions.sse"))
    ll = S.read_stream(0.5, sse("llama-server-completions.sse"))
    for r in (m, ll):
        assert r["text"] == '    """Return the pattern of' and r["completion_tokens"] == 6
        assert r["ttft_s"] == pytest.approx(0.5) and len(r["itl_s"]) == 5
        assert all(x == pytest.approx(0.2) for x in r["itl_s"])  # a blank line between events
    assert m["server_timings"] is None
    assert ll["server_timings"]["predicted_n"] == 6 and ll["server_timings"]["prompt_n"] == 7
    with pytest.raises(RuntimeError, match="no tokens"):
        S.read_stream(0.0, [(1.0, "data: [DONE]")])


def test_levels_side_by_side_and_the_receipt(tmp_path):
    reqs = {name: [dict(S.read_stream(0.5, sse(f)), prompt=0)] for name, f in
            (("muser", "muser-serve-completions.sse"), ("llama-server", "llama-server-completions.sse"))}
    results = {name: [S.level_stats(1, 2.0, rs, 6)] for name, rs in reqs.items()}
    assert results["muser"][0]["throughput_tok_s"] == pytest.approx(3.0)
    with pytest.raises(RuntimeError, match="completion_tokens"):
        S.level_stats(1, 2.0, reqs["muser"], 16)
    table = S.side_by_side(results)
    assert [row["clients"] for row in table] == [1]
    assert set(table[0]) == {"clients", "muser", "llama-server"}
    assert table[0]["llama-server"]["ttft_p50_s"] == pytest.approx(0.5)
    gate = S._gate(results)
    assert gate["status"] == "pass"
    p = write_receipt("serve", model={"path": "m.gguf"}, device={"kind": "cpu"}, lane="exact", gate=gate,
                      results=results, out_dir=tmp_path, extra={"side_by_side": table})
    assert verify_receipt(p) == []


def test_llama_server_runs_the_slots_asked_for():
    log = (DATA / "llama-server-start.log").read_text().splitlines()
    assert S.check_llama_slots(log, 4, 1024) == {"n_slots": 4, "n_ctx_slot": 1024, "kv_unified": False}
    with pytest.raises(ComparatorError, match="not 4 slots of 2048"):
        S.check_llama_slots(log, 4, 2048)
    with pytest.raises(ComparatorError, match="initializing"):
        S.check_llama_slots(log[:3], 4, 1024)
    argv = S.llama_server_argv("/b/llama-server", "m.gguf", 8080, 4, 1024, 1)
    assert {k: value(argv, k) for k in ("-np", "-c", "-t", "-tb", "-m")} == \
        {"-np": "4", "-c": "4096", "-t": "1", "-tb": "1", "-m": "m.gguf"}
    assert "--no-kv-unified" in argv


def test_request_bodies_differ_only_by_llama_servers_prompt_cache():
    m = S.request_body("m", "p", 16, [1, 2], llama=False)
    ll = S.request_body("m", "p", 16, [1, 2], llama=True)
    assert m["logit_bias"] == {"1": -100, "2": -100} and m["temperature"] == 0 and m["stream"] is True
    assert ll.pop("cache_prompt") is False and ll == m


@pytest.mark.parametrize("argv, says", [
    (["bench", "spec", "--against", "llama.cpp"], "--llama-spec PATH is required"),
    (["bench", "spec", "--llama-spec", "/bin/true"], "only run with --against llama.cpp"),
    (["bench", "spec", "--against", "llama.cpp", "--llama-spec", "/nonexistent/llama-speculative-simple"],
     "is not an executable file"),
    (["bench", "spec", "--threads", "0"], "--threads must be >= 1"),
    (["bench", "serve", "--against", "llama-server"], "--llama-server PATH is required"),
    (["bench", "serve", "--llama-server", "/bin/true"], "only run with --against llama-server"),
    (["bench", "serve", "--against", "llama-server", "--llama-server", str(DATA)], "is not an executable file"),
])
def test_comparator_flags_are_refused_before_any_work(argv, says, capsys, tmp_path):
    assert main([*argv, "--out-dir", str(tmp_path)]) != 0
    assert says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_serve_threads_are_refused_below_one(capsys):
    assert main(["serve", "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
