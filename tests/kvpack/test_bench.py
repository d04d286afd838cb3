"""`muser bench kvpack` end to end on the tiny fixture (one repetition): the receipt's gate, mode
and byte accounting, not its timings (benchmarks are commands, not timed tests)."""

from __future__ import annotations

import json

import pytest

from muser.bench.kinds.kvpack import plan
from muser.bench.plot import PNG_MAGIC
from muser.cli import main


def _receipt(tmp_path) -> dict:
    (receipt,) = tmp_path.glob("*-kvpack.json")
    return json.loads(receipt.read_text())


def test_bench_kvpack_receipt(tiny_gguf, tmp_path):
    argv = ["bench", "kvpack", "--model", str(tiny_gguf), "--lengths", "530", "--reps", "1", "--warmup", "0",
            "--gate-tokens", "2", "--out-dir", str(tmp_path), "--plot"]
    assert main(argv) == 0
    (receipt,) = tmp_path.glob("*-kvpack.json")
    assert receipt.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC  # bare --plot: next to the receipt
    r = _receipt(tmp_path)
    assert r["gate"]["status"] == "pass"
    assert r["results"]["mode"]["name"] == r["gate"]["mode"] == "replay"
    g = r["gate"]["per_length"]["530"]
    assert g["restored"] == 512 and g["bitwise_first_logits"] and g["text_identical"]
    res = r["results"]["lengths"]["530"]
    assert res["kv_payload_bytes"] == res["formula_kv_bytes"] and res["stored_prefix_tokens"] == 512
    assert res["prompt_tokens"] == res["prime_tokens"] == res["shared_with_prime_tokens"] == 530
    assert 0 < res["overhead_bytes"] < 16384
    # bytes on disk are the byte format's: headers + manifests + tiles, to the byte
    assert res["disk_equals_formula"] and res["bytes_on_disk"] == res["disk_formula"]["bytes"]
    assert r["gate"]["bytes"]["530"] == {"payload_equals_formula": True, "disk_equals_formula": True}
    disk = r["results"]["disk_read"]
    assert disk["bytes"] >= 16 << 20 and len(disk["bytes_per_s"]) == 3
    for mode in ("cold", "warm"):
        t = res[f"restore_{mode}"]
        assert len(t["restore_s"]) == len(t["read_verify_s"]) == len(t["read_then_install_s"]) == 5
        assert t["restore_vs_disk_read"] > 0
    assert len(res["restore_cold"]["resident_after_drop"]) == 15  # before each timed read
    assert set(r["cells"]) == {"cold/530", "warm/530"}


def test_bench_kvpack_new_question(tiny_gguf, tmp_path):
    """A stored document + a new question: warm restores the document's complete chunks (all of a
    512-token document, 512 of a 700-token one), prefills the rest, bitwise the cold logits."""
    argv = ["bench", "kvpack", "--model", str(tiny_gguf), "--lengths", "512,700", "--suffix-tokens", "24",
            "--reps", "1", "--warmup", "0", "--gate-tokens", "2", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    r = _receipt(tmp_path)
    assert r["gate"]["status"] == "pass"
    assert r["results"]["mode"]["name"] == r["gate"]["mode"] == "new-question"
    assert r["results"]["mode"]["suffix_tokens"] == 24
    for n in (512, 700):
        g = r["gate"]["per_length"][str(n)]
        assert g["restored"] == g["expected_restored"] == 512 and g["restored_as_expected"]
        assert g["suffix_tokens"] == n + 24 - 512 and g["suffix_start_on_chunk_boundary"]
        assert g["bitwise_first_logits"] and g["max_abs_delta_first_logits"] == 0.0
        assert g["greedy_ids_identical"] and g["text_identical"]
        res = r["results"]["lengths"][str(n)]
        assert res["mode"] == "new-question" and res["document_tokens"] == n and res["prompt_tokens"] == n + 24
        assert res["stored_prefix_tokens"] == 512 and res["suffix_prefill_tokens"] == n + 24 - 512
        assert res["shared_with_prime_tokens"] == n  # the questions differ from their first token on
        assert res["payload_equals_formula"] and res["disk_equals_formula"]
        assert len(res["warm_restore_s"]) == 1 and 0 < res["warm_restore_share"] < 1
        # one repetition, no warm-up: one sample per cell, and no spread claimed
        assert res["ttft_cold_cv"] is None and res["ttft_warm_cv"] is None
        for cell in (f"cold/{n}", f"warm/{n}"):
            assert len(r["cells"][cell]["samples_s"]) == 1 and r["cells"][cell]["warmup_s"] == []
    p = r["results"]["protocol"]
    assert p["single_repetition"] is True and (p["reps"], p["warmup"]) == (1, 0)


class _Tok:
    """A tokenizer stand-in: one id per character (BOS = 1 when add_special)."""

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return ([1] if add_special else []) + [ord(c) for c in text]


@pytest.mark.parametrize("n,q", [(512, 1), (512, 512), (1024, 100), (700, 324), (1536, 8), (2047, 1)])
def test_plan_new_question_primes_exactly_the_document_chunks(n, q):
    """The priming prompt's last chunk boundary before its final token (where the SWA tail is
    stored) is the document's last complete chunk, and the timed prompt shares only the document."""
    ch = 512
    p = plan(_Tok(), n, q, ch)
    b = n // ch * ch
    assert p["mode"] == "new-question" and p["restore"] == b
    assert (len(p["prime"]) - 1) // ch * ch == b
    assert p["timed"][:n] == p["prime"][:n] and len(p["timed"]) == n + q
    assert p["timed"][n] != p["prime"][n]


def test_plan_replay_restores_up_to_the_last_boundary_before_the_final_token():
    p = plan(_Tok(), 1024, 0, 512)
    assert p["mode"] == "replay" and p["prime"] == p["timed"] and len(p["timed"]) == 1024 and p["restore"] == 512


@pytest.mark.parametrize("lengths,q,needle", [
    ("300", 8, "document lengths [300] hold no complete 512-token chunk"),
    ("700", 325, "for document lengths [700] the tokens after the last 512-token boundary plus the question"),
    ("1024", 513, "for document lengths [1024]"),
    ("1024", -1, "--suffix-tokens -1 (>= 0)"),
])
def test_bench_kvpack_refuses_a_suffix_that_cannot_be_measured(tiny_gguf, tmp_path, capsys, lengths, q, needle):
    argv = ["bench", "kvpack", "--model", str(tiny_gguf), "--lengths", lengths, "--suffix-tokens", str(q),
            "--out-dir", str(tmp_path)]
    assert main(argv) != 0
    assert needle in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))
