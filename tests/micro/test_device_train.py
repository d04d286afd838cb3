"""The one-call device pipeline (tools/device_train.py) on the CPU: a tiny carry -> tokenize -> sweep ->
main run -> drafter -> the files the device returns -> GGUF target and drafter that load; the sweep's
size rule; per-file scoring that counts every token once."""

from __future__ import annotations

import hashlib
import json
import lzma
import math

import numpy as np
import pytest
import torch

from .conftest import _load

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def device_mod():
    return _load("device_train")


def _rec(label, n, loss):
    return {"label": label, "n_params": n, "geometry": {"hidden": n}, "best": {"val_select_loss": loss}}


def test_choose_size_interior_minimum_scales_with_compute(device_mod):
    sweep = [_rec("a", 4e6, 3.0), _rec("b", 8e6, 2.8), _rec("c", 16e6, 2.9)]
    c = device_mod.choose_size(sweep, main_s=35.0, sweep_s=35.0)  # same compute: the vertex, nearest is b
    assert c["chosen"] == "b" and 4e6 < c["n_star_at_sweep"] < 16e6 and "vertex" in c["how"]
    c = device_mod.choose_size(sweep, main_s=35.0 * 16, sweep_s=35.0)  # 16x compute: N* x 4
    assert c["chosen"] == "c" and c["n_target_at_main"] == pytest.approx(4 * c["n_star_at_sweep"], rel=1e-6)


def test_choose_size_end_cap_and_failures(device_mod):
    sweep = [_rec("a", 4e6, 2.5), _rec("b", 8e6, 2.6), _rec("c", 16e6, 2.7)]
    assert device_mod.choose_size(sweep, 35.0, 35.0)["chosen"] == "a"  # the winning end, not extrapolated
    big = [_rec("a", 4e6, 3.0), _rec("b", 8e6, 2.9), _rec("huge", 64e6, 2.0)]
    assert device_mod.choose_size(big, 350.0, 35.0)["chosen"] == "b"  # over MAX_PARAMS: never chosen
    failed = [dict(_rec("a", 4e6, 2.0), error="boom"), _rec("b", 8e6, float("nan")), _rec("c", 16e6, 2.9)]
    assert device_mod.choose_size(failed, 35.0, 35.0)["chosen"] == "c"
    with pytest.raises(SystemExit, match="every sweep run failed"):
        device_mod.choose_size([dict(_rec("a", 4e6, 2.0), error="boom")], 35.0, 35.0)


def test_doc_nll_scores_every_token_after_bos_once(train_mod):
    import micro_net

    g = micro_net.Geometry(vocab=64, **micro_net.SMOKE)
    m = micro_net.MicroGlimmer(g)
    m.reset(3)
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, 64, n)) for n in (2, 10, 64, 65, 130)]  # L = 64: 1, 1, 1, 2, 3 chunks
    tot, cnt = train_mod.doc_nll(m, seqs, 64, "cpu", batch=2)
    assert cnt == sum(len(s) - 1 for s in seqs)
    want = 0.0
    with torch.no_grad():
        for s in seqs:
            for j in range(0, len(s) - 1, 63):
                c = torch.tensor([s[j: j + 64]])
                lp = torch.log_softmax(m(c)[0, :-1].double(), -1)
                want -= float(lp.gather(1, c[0, 1:, None]).sum())
    assert math.isclose(tot, want, rel_tol=1e-5)


@pytest.fixture(scope="module")
def tiny_carry(corpus_mod, tmp_path_factory):
    """A carry in the format tools/corpus_carry.py reads: a 512-token BPE, 2 train shards, val, and a
    held-out shard holding the first 6 stdlib held-out files (the listing names 3 of them)."""
    carry_mod = _load("corpus_carry")
    from muser.corpus import frame

    out = tmp_path_factory.mktemp("carry")
    docs = corpus_mod.load_docs()
    pick = {"train": corpus_mod.split_docs(docs, "train")[:24], "val": corpus_mod.split_docs(docs, "val")[:4],
            "heldout": corpus_mod.split_docs(docs, "heldout")[:6]}
    tok = corpus_mod.train_tokenizer([d.text for d in pick["train"]], vocab_size=512)
    tok.save(str(out / "tokenizer.json"))
    man = {"tokenizer": {"sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
                         "vocab_size": 512}, "carried": {}, "full": {}}
    for split, ds in pick.items():
        parts = {"train-00.xz": ds[:12], "train-01.xz": ds[12:]} if split == "train" else {f"{split}.xz": ds}
        shards = []
        for fn, part in parts.items():
            blob = b"".join(frame(d.relpath, d.data) for d in part)
            xz = lzma.compress(blob)
            (out / fn).write_bytes(xz)
            n = carry_mod.encode(tok, [(d.relpath, d.data) for d in part]).size
            shards.append({"file": fn, "xz_sha256": hashlib.sha256(xz).hexdigest(),
                           "sha256": hashlib.sha256(blob).hexdigest(), "docs": len(part), "tokens": int(n)})
        man["carried"][split] = {"shards": shards}
    (out / "corpus.json").write_text(json.dumps(man))
    listing = out / "stdlib-heldout.json"
    listing.write_text(json.dumps({"files": [{"relpath": d.relpath, "sha256": hashlib.sha256(d.data).hexdigest(),
                                              "bytes": len(d.data)} for d in pick["heldout"][:3]]}))
    return out, listing


@pytest.fixture(scope="module")
def device_run(device_mod, tiny_carry, tmp_path_factory):
    carry, listing = tiny_carry
    out = tmp_path_factory.mktemp("device-out")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only spin on the shared cores
    try:
        rc = device_mod.main(["--carry", str(carry), "--streams", str(tmp_path_factory.mktemp("streams")),
                              "--stdlib-heldout", str(listing), "--out", str(out), "--smoke"])
    finally:
        torch.set_num_threads(threads)
        device_mod.tm.STOP["why"] = None
    assert rc == 0
    return out


def test_device_run_returns_what_the_device_can_send(device_run):
    files = sorted(p for p in device_run.iterdir() if not p.name.startswith("."))
    assert len(files) <= 8 and all(p.stat().st_size <= 16 << 20 for p in files)
    assert sum(p.stat().st_size for p in files) <= 64 << 20
    run = json.loads((device_run / "micro-run.json").read_text())
    assert run["status"] == "done" and set(run["stages"]) == {"tokenize", "sweep", "main", "drafter"}
    assert [r["label"] for r in run["sweep"]] == ["sweep-32", "sweep-48", "sweep-64"]
    assert all(r["steps"] == 6 and r["curve"] and math.isfinite(r["best"]["val_select_loss"]) for r in run["sweep"])
    assert run["choice"]["chosen"] in {r["label"] for r in run["sweep"]}
    assert run["geometry"]["hidden"] == run["choice"]["geometry"]["hidden"]
    b = run["main"]["best"]
    assert math.isfinite(b["val_loss"]) and math.isfinite(b["heldout_loss"])
    s = run["stdlib_heldout"]
    assert s["files"] == 3 and s["bits_per_byte"] > 0 and s["scored_tokens"] > 0
    assert run["drafter"]["status"] == "done" and run["drafter"]["draft"]["target_layers"] == [1, 4, 7]
    for shard in run["weights"]["shards"]:  # the F16 master: 2-D tensors F16
        with np.load(device_run / shard) as z:
            assert {z[k].dtype for k in z.files if z[k].ndim == 2} <= {np.dtype("float16")}


def test_device_run_exports_to_gguf_that_load(device_run, tiny_carry, export_mod, tmp_path):
    from muser.model.loader import open_model
    from muser.spec.format import open_drafter

    td = _load("train_drafter")
    carry, _ = tiny_carry
    written = export_mod.export(device_run, carry / "tokenizer.json", tmp_path, ("F16", "Q8_0"), quant="gguf",
                                log=lambda *_: None)
    run = json.loads((device_run / "micro-run.json").read_text())
    for path in written.values():
        m = open_model(path, pin=path.with_suffix(".pin.json"))
        try:
            assert m.config.hidden == run["geometry"]["hidden"] and m.config.context_length == 64
        finally:
            m.close()
    draft = tmp_path / "d.gguf"
    assert td.export(device_run, written["F16"], draft) == 0
    f, cfg = open_drafter(draft)
    f.close()
    assert list(cfg.target_layers) == [1, 4, 7]
    with pytest.raises(export_mod.ExportError, match="tokenizer"):
        other = tmp_path / "tok.json"
        other.write_text((carry / "tokenizer.json").read_text().replace('"<|mask|>"', '"<|masq|>"'))
        export_mod.export(device_run, other, tmp_path / "x", ("F16",), quant="gguf", log=lambda *_: None)
