"""The corpus rule: reproducible file list, fixed held-out rule, split hashes pinned."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

# The split hashes of the CPython 3.11.7 standard library on our machines (models/README.md).
PINNED = {
    "train": (1627, 28810236, "f07def42526aba18399af1b02b17f6969b97a394c153949781431e84aef7640b"),
    "val": (48, 680909, "b08f93d8de056ef79043467e674403318c7e8c2d7885d355239ae939f62b24fe"),
    "heldout": (108, 1225024, "d9d2a9afd33c5121276e81c1fc8f0d4b04a5d1e1294926d13a34cb52cb2c0573"),
}
NON_UTF8 = [
    "test/encoded_modules/module_iso_8859_1.py",
    "test/encoded_modules/module_koi8_r.py",
    "test/test_source_encoding.py",
    "test/tokenizedata/badsyntax_pep3120.py",
]


@pytest.fixture(scope="module")
def docs(all_docs):
    return all_docs


def test_split_hashes_reproduce(corpus_mod, docs):
    rels, non_utf8 = corpus_mod.list_sources()
    assert non_utf8 == NON_UTF8
    s = corpus_mod.corpus_summary(docs, non_utf8, corpus_mod.DEFAULT_ROOT)
    for split, (files, nbytes, sha) in PINNED.items():
        got = s["splits"][split]
        assert (got["files"], got["bytes"], got["sha256"]) == (files, nbytes, sha), split


def test_rule(corpus_mod, docs):
    rels = [d.relpath for d in docs]
    assert rels == sorted(rels)
    assert len(set(rels)) == len(rels)
    assert not any(r.startswith(("site-packages/", "config-3.11-")) or "__pycache__" in r for r in rels)
    assert not any(r.rsplit("/", 1)[-1].startswith("_sysconfigdata_") for r in rels)
    assert "pydoc_data/topics.py" not in rels
    assert "os.py" in rels and "test/test_typing.py" in rels and "idlelib/editor.py" in rels
    held = [d for d in docs if d.split == "heldout"]
    assert len(held) / len(docs) >= 0.05
    for d in docs:  # the fixed rule, recomputed independently
        b = hashlib.sha256(d.relpath.encode()).digest()[0]
        assert d.split == ("heldout" if b < 16 else "val" if b < 24 else "train")


def test_hash_framing_is_unambiguous(corpus_mod):
    D = corpus_mod.Doc
    a = corpus_mod.split_sha256([D("a.py", b"x\n", "train"), D("b.py", b"y", "train")])
    # moving a byte across the file boundary, or into the name, changes the hash
    assert a != corpus_mod.split_sha256([D("a.py", b"x", "train"), D("b.py", b"\ny", "train")])
    assert a != corpus_mod.split_sha256([D("a.py", b"x\nb.py", "train")])
    assert a == corpus_mod.split_sha256([D("a.py", b"x\n", "train"), D("b.py", b"y", "train")])


def test_unknown_split_and_bad_root_refused(corpus_mod, tmp_path):
    with pytest.raises(corpus_mod.CorpusError, match="unknown split 'test'"):
        corpus_mod.split_docs([], "test")
    with pytest.raises(corpus_mod.CorpusError, match="not a CPython standard-library"):
        corpus_mod.list_sources(tmp_path)


def test_small_build_streams(corpus_mod, small_corpus, all_docs):
    man = json.loads((small_corpus / "corpus.json").read_text())
    assert man["tokenizer"]["vocab_size"] == 512 and man["tokenizer"]["pre"] == "llama4"
    docs = all_docs
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(small_corpus / "tokenizer.json"))
    for split in corpus_mod.SPLITS:
        ids = np.fromfile(small_corpus / f"{split}.u16", dtype="<u2")
        assert ids.size == man["streams"][split]["tokens"]
        assert hashlib.sha256(ids.tobytes()).hexdigest() == man["streams"][split]["sha256"]
        first = corpus_mod.split_docs(docs, split)[0]
        n = len(tok.encode(first.text, add_special_tokens=False).ids)
        # framing: [BOS] ids [EOS] per file
        assert ids[0] == 0 and ids[n + 1] == 1
        assert list(ids[1 : n + 1]) == tok.encode(first.text, add_special_tokens=False).ids
