"""The package corpus: the file rule and split on a tiny synthetic sdist, the framing, the carry round
trip through tokenize_carry, and the committed manifest's self-consistency."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import numpy as np
import pytest

from muser import corpus as C


def _tar(path, files: dict[str, bytes], links: dict[str, str] | None = None):
    with tarfile.open(path, "w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            t.addfile(info)


def _stdlib(root):
    (root / "test").mkdir(parents=True)
    (root / "os.py").write_bytes(b"import sys\n")
    (root / "test" / "t.py").write_bytes(b"x = 1\n")
    return root


PKG_FILES = {
    "demo-1.0/PKG-INFO": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\nLicense-Expression: MIT\n\nbody\n",
    "demo-1.0/src/demo/__init__.py": b"from .core import f\n",
    "demo-1.0/src/demo/core.py": b"def f(x):\n    return x + 1\n",
    "demo-1.0/tests/test_core.py": b"from demo import f\n\ndef test_f():\n    assert f(1) == 2\n",
    "demo-1.0/docs/conf.py": b"project = 'demo'\n",
    "demo-1.0/src/demo/empty.py": b"",
    "demo-1.0/src/demo/latin.py": b"s = '\xe9'\n",
    "demo-1.0/src/demo/nul.py": b"a\0b\n",
    "demo-1.0/src/demo/tok.py": b"'<|eot|>'\n",
    "demo-1.0/src/demo/copy_of_os.py": b"import sys\n",  # the fake stdlib's os.py: a duplicate
    "demo-1.0/src/demo/data.bin": b"\x00\x01",
    "demo-1.0/README.md": b"# demo\n",
}


def test_rule_on_synthetic_sdist(tmp_path, corpus_pkgs):
    sd = tmp_path / "sdists"
    sd.mkdir()
    _tar(sd / "demo-1.0.tar.gz", PKG_FILES, links={"demo-1.0/src/demo/link.py": "core.py"})
    sha = hashlib.sha256((sd / "demo-1.0.tar.gz").read_bytes()).hexdigest()
    pinned = {"packages": [{"name": "demo", "version": "1.0", "sdist": "demo-1.0.tar.gz", "sha256": sha}]}
    root = _stdlib(tmp_path / "stdlib")
    res = corpus_pkgs.extract(pinned, sd, tmp_path / "docs", root, log=lambda *_: None)
    (e,) = res["packages"]
    assert e["license"] == "MIT" and e["sha256"] == sha
    assert e["dropped"] == {"duplicate": 1, "empty": 1, "non_utf8": 1, "nul": 1, "special": 1}
    docs = corpus_pkgs.read_package(tmp_path / "docs", "demo")
    assert [r for r, _ in docs] == ["demo/docs/conf.py", "demo/src/demo/__init__.py", "demo/src/demo/core.py",
                                    "demo/tests/test_core.py"]
    assert e["files"] == 4 and e["bytes"] == sum(len(d) for _, d in docs)
    # deterministic: a second run gives the same entries and bytes
    res2 = corpus_pkgs.extract(pinned, sd, tmp_path / "docs2", root, log=lambda *_: None)
    assert res2 == res
    assert (tmp_path / "docs" / "demo.frames").read_bytes() == (tmp_path / "docs2" / "demo.frames").read_bytes()
    # a changed sdist is refused before anything is written
    pinned["packages"][0]["sha256"] = "0" * 64
    with pytest.raises(C.CorpusError, match="sha256 differs"):
        corpus_pkgs.extract(pinned, sd, tmp_path / "docs3", root, log=lambda *_: None)
    assert not (tmp_path / "docs3" / "demo.frames").exists()


def test_package_split_rule():
    for name in ("django", "sympy", "requests", "demo"):
        held = hashlib.sha256(b"package:" + name.encode()).digest()[0] < 8
        assert C.package_heldout(name) == held
        for rel in (f"{name}/a.py", f"{name}/tests/test_b.py", f"{name}/docs/conf.py"):
            b = hashlib.sha256(rel.encode()).digest()[0]
            want = "heldout" if held else ("val" if b < 4 else "train")
            assert C.package_split_of(name, rel) == want
    assert C.canonical_name("Zope.Interface") == C.canonical_name("zope_interface") == "zope-interface"
    assert C.package_heldout("Zope.Interface") == C.package_heldout("zope-interface")


def test_framing_round_trips_and_refuses_truncation():
    docs = [("a/b.py", b"x\n1\n"), ("c.py", b""), ("d/\u00e9.py", "\u00e9\n".encode())]
    blob = b"".join(C.frame(r, d) for r, d in docs)
    assert C.unframe(blob) == docs
    # the same bytes hash as the split hash framing
    assert hashlib.sha256(blob).hexdigest() == C.split_sha256([C.Doc(r, d, "train") for r, d in docs])
    with pytest.raises(C.CorpusError, match="runs past the end"):
        C.unframe(blob[:-1])
    with pytest.raises(C.CorpusError, match="bad header"):
        C.unframe(b"a.py\nx\n")
    with pytest.raises(C.CorpusError, match="holds a newline"):
        C.frame("a\nb.py", b"")


def test_carry_round_trip(tmp_path, corpus_mod, corpus_write, corpus_carry):
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "x", "y", "(", ")", ":", "\n    "]
    docs = []
    for i in range(60):
        text = " ".join(rng.choice(words, 40)) + "\n"
        split = "train" if i < 40 else "val" if i < 50 else "heldout"
        prefix = corpus_write.STDLIB_PREFIX if i >= 55 else f"p{i % 3}/"
        docs.append((f"{prefix}m{i:02d}.py", text.encode(), split))
    tok = corpus_mod.train_tokenizer([d.decode() for _, d, s in docs if s == "train"], vocab_size=300)
    tok_path = tmp_path / "tok.json"
    tok.save(str(tok_path))
    info = {"sha256": hashlib.sha256(tok_path.read_bytes()).hexdigest(), "vocab_size": 300, "vocab_sha256": "x"}
    fr = {"train": 0.5, "val": 1.0, "heldout": 0.0}
    man = corpus_write.write_carry(tmp_path / "carry", tok_path, docs, fr, 1 << 20, {}, info, [],
                                   log=lambda *_: None)
    # held-out keeps every stdlib file even at fraction 0; train is the deterministic half
    assert man["carried"]["heldout"]["files"] == 5 and man["carried"]["val"]["files"] == 10
    want_train = [r for r, _, s in docs if s == "train" and corpus_write.unit(b"carry", r) < 0.5]
    assert 0 < len(want_train) < 40 and man["carried"]["train"]["files"] == len(want_train)
    got = corpus_carry.tokenize_carry(tmp_path / "carry", tmp_path / "out", log=lambda *_: None)
    for split in C.SPLITS:
        ids = np.fromfile(tmp_path / "out" / f"{split}.u16", dtype="<u2")
        assert ids.size == got["streams"][split]["tokens"] == man["carried"][split]["tokens"]
        assert hashlib.sha256(ids.tobytes()).hexdigest() == got["streams"][split]["sha256"]
    ids = np.fromfile(tmp_path / "out" / "train.u16", dtype="<u2")
    first = next(d for r, d, s in docs if r == want_train[0])
    n = len(tok.encode(first.decode(), add_special_tokens=False).ids)
    assert ids[0] == 0 and ids[n + 1] == 1
    # without counts in the carry, tokenize_carry counts; the same streams come out
    man2 = corpus_write.write_carry(tmp_path / "carry2", tok_path, docs, fr, 1 << 20, {}, info, [],
                                    count_tokens=False, log=lambda *_: None)
    assert man2["carried"]["train"]["tokens"] is None
    got2 = corpus_carry.tokenize_carry(tmp_path / "carry2", tmp_path / "out3", log=lambda *_: None)
    assert got2["streams"] == got["streams"]
    assert got2["splits"]["train"]["tokens"] == got["streams"]["train"]["tokens"]
    # a corrupted shard is refused by hash
    shard = tmp_path / "carry" / "val.xz"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    with pytest.raises(C.CorpusError, match="val.xz: sha256 differs"):
        corpus_carry.tokenize_carry(tmp_path / "carry", tmp_path / "out2", log=lambda *_: None)


def test_manifest_self_consistent(corpus_mod):
    man = json.loads(corpus_mod.MANIFEST.read_text())
    assert corpus_mod.MANIFEST.stat().st_size < 1 << 20
    pinned = json.loads((corpus_mod.REPO / "tools" / "corpus_packages.json").read_text())
    pins = {p["name"]: p for p in pinned["packages"]}
    pk = man["packages"]
    assert [p["name"] for p in pk] == sorted(p["name"] for p in pk)
    for p in pk:
        assert p["license"] and len(p["sha256"]) == 64 and pins[p["name"]]["sha256"] == p["sha256"]
        assert p["version"] == pins[p["name"]]["version"] and p["sdist"] == pins[p["name"]]["sdist"]
        assert p["heldout"] == C.package_heldout(p["name"])
        assert p["files"] == sum(p["split_files"].values()) and p["bytes"] == sum(p["split_bytes"].values())
        assert set(p["split_files"]) <= ({"heldout"} if p["heldout"] else {"train", "val"})
    assert man["heldout_packages"] == [p["name"] for p in pk if p["heldout"]]
    assert 0.015 < len(man["heldout_packages"]) / len(pk) < 0.06
    std = man["stdlib"]["splits"]
    for s in C.SPLITS:
        tot = man["splits"][s]
        assert tot["files"] == std[s]["files"] + sum(p["split_files"].get(s, 0) for p in pk)
        assert tot["bytes"] == std[s]["bytes"] + sum(p["split_bytes"].get(s, 0) for p in pk)
        assert len(tot["sha256"]) == 64
        smp = tot["token_sample"]
        assert 0 < smp["files"] < tot["files"] and 0 < smp["bytes"] < tot["bytes"] and smp["tokens"] > 0
        assert tot["tokens_estimate"] == round(tot["bytes"] * smp["tokens"] / smp["bytes"])
        assert std[s]["tokens"] > 0
        car = man["carry"]
        assert car["splits"][s]["tokens"] == sum(i["tokens"] for i in car["shards"][s])
        assert car["splits"][s]["files"] == sum(i["docs"] for i in car["shards"][s]) <= tot["files"]
        assert car["splits"][s]["bytes"] <= tot["bytes"]
    assert sum(man["splits"][s]["tokens_estimate"] for s in C.SPLITS) >= 300_000_000
    assert man["carry"]["carry_bytes"] <= 50 << 20
    # every stdlib held-out file is carried
    assert man["carry"]["splits"]["heldout"]["files"] >= std["heldout"]["files"]
    # the stdlib part is the pinned stdlib rule (tests/micro/test_corpus.py holds its hashes)
    assert std["heldout"]["sha256"] == "d9d2a9afd33c5121276e81c1fc8f0d4b04a5d1e1294926d13a34cb52cb2c0573"
    assert len(man["tokenizer"]["sha256"]) == 64 and man["tokenizer"]["vocab_size"] == 8192
