"""The drafter-only device run (tools/train_drafter.py): the KV-cached greedy decode against full
recompute, the shipped Q8_0 target dequantized into tools/micro_net.py's graph against llama.cpp's greedy
path, the carry's split rule and hashes, and the CPU smoke run end to end through export into a sidecar
that pairs with the shipped target."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from .conftest import SHIPPED, _load

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def td():
    return _load("train_drafter")


@pytest.fixture(scope="module")
def carry(td, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter-carry")
    td.write_carry(out)
    return out


def test_cached_greedy_equals_full_recompute():
    mn = _load("micro_net")

    g = mn.Geometry(vocab=97, **mn.SMOKE)  # window 16 < the 20 + 40 positions: the sliding mask matters
    m = mn.MicroGlimmer(g)
    m.reset(1)
    prompt = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(0))
    got = m.greedy(prompt, 40)
    cur = prompt
    with torch.no_grad():
        for _ in range(40):
            cur = torch.cat((cur, m(cur)[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(got, cur)
    with pytest.raises(ValueError, match="exceeds the context"):
        m.greedy(prompt, g.seq_len)


def test_shipped_target_follows_llamacpp_greedy(td, export_mod):
    """The dequantized Q8_0 in f32 against the pinned llama.cpp's stored greedy ids (same file): the
    labels the drafter learns are the shipped model's argmax, up to rare rounding flips."""
    from muser.gguf.reader import read_gguf
    from muser.text import Tokenizer

    path = SHIPPED / "muse-glimmer-micro-q8_0.gguf"
    stored = json.loads((SHIPPED / "muse-glimmer-micro-continuations.json").read_text())
    run = next(r for r in stored["runs"] if r["model"]["file"] == path.name)
    if run["model"]["artifact_sha256"] != hashlib.sha256(path.read_bytes()).hexdigest():
        pytest.skip("the continuations file was written for another model file")
    model, geo, facts = td.load_target(path, "cpu")
    assert facts["identity"].artifact_sha256 == run["model"]["artifact_sha256"]
    assert geo.q_scale == pytest.approx(3.87) and facts["ids"]["mask"] == 3
    f = read_gguf(path)
    try:
        tok = Tokenizer.from_gguf(f)
    finally:
        f.close()
    c = run["continuations"][0]
    ids = [facts["ids"]["bos"]] + tok.encode(export_mod.prompt_text(c["file"], c["prompt_lines"]), add_special=False)
    assert len(ids) == c["prompt_tokens"]
    want = c["llamacpp_ids"][:32]
    got = model.greedy(torch.tensor([ids]), len(want))[0, len(ids):].tolist()
    assert got == want


def test_carry_follows_the_split_rule(carry):
    from muser import corpus

    cc = _load("corpus_carry")
    man = json.loads((carry / "drafter-carry.json").read_text())
    docs = corpus.load_docs()
    train = cc.read_shard(carry, man["shards"]["train"])  # checks both SHA-256s and the count
    held = cc.read_shard(carry, man["shards"]["heldout"])
    assert [r for r, _ in train] == [d.relpath for d in corpus.split_docs(docs, "train")[::2]]
    assert [r for r, _ in held] == [d.relpath for d in corpus.split_docs(docs, "heldout")]
    assert man["shards"]["heldout"]["sha256"] == corpus.split_sha256(corpus.split_docs(docs, "heldout"))
    assert sum(p.stat().st_size for p in carry.iterdir()) < 8 << 20
    (carry / "train.xz").write_bytes((carry / "train.xz").read_bytes()[:-1] + b"\0")
    with pytest.raises(corpus.CorpusError, match="sha256"):
        cc.read_shard(carry, man["shards"]["train"])
    bench = (carry / "bench-heldout.u16").read_bytes()
    (carry / "train.xz").unlink()
    (carry / "bench-heldout.u16").unlink()
    _load("train_drafter").write_carry(carry)  # rebuilt byte for byte
    assert json.loads((carry / "drafter-carry.json").read_text()) == man
    assert (carry / "bench-heldout.u16").read_bytes() == bench
    assert hashlib.sha256((carry / "train.xz").read_bytes()).hexdigest() == man["shards"]["train"]["xz_sha256"]


def test_carry_holds_the_bench_prompts(td, carry):
    """The carried held-out prompts are `muser bench spec`'s own (its code, the held-out split), so the
    run's per-round metric scores the bench's first prompts among more of the same classes."""
    import muser
    from muser import corpus
    from muser.bench.kinds.spec import natural_mid_prompts, natural_prompts, synthetic_prompt

    man = json.loads((carry / "drafter-carry.json").read_text())
    rows = td.read_bench_prompts(carry, man)
    m = muser.load(SHIPPED / "muse-glimmer-micro-q8_0.gguf", device="cpu")
    try:
        nat = natural_prompts(m, 5, 256, None)
        mid, _ = natural_mid_prompts(m, [name for name, _ in nat], 256, None)
        syn = synthetic_prompt(m, 256)
    finally:
        m.close()
    by_cls = {c: [(n, ids) for k, n, ids in rows if k == c] for c in ("natural", "natural-mid", "synthetic")}
    assert by_cls["natural"][:5] == nat and by_cls["synthetic"] == [syn]
    assert [x for x in by_cls["natural-mid"] if x[0].split("@")[0] in dict(nat)] == mid
    held = {d.relpath for d in corpus.split_docs(corpus.load_docs(), "heldout")}
    assert len(by_cls["natural"]) > 50 and {n.split("@")[0] for n, _ in by_cls["natural"] + by_cls["natural-mid"]} <= held
    (carry / "bench-heldout.u16").write_bytes(b"\1\0" + (carry / "bench-heldout.u16").read_bytes()[2:])
    with pytest.raises(SystemExit, match="sha256"):
        td.read_bench_prompts(carry, man)
    td.write_carry(carry)


@pytest.fixture(scope="module")
def train_prompts(td, carry):
    """TrainPrompts over the carried train shard, tokenized as distill-device does, with the muser
    tokenizer of the same GGUF and the shard's documents."""
    from muser.gguf.reader import read_gguf
    from muser.text import Tokenizer

    cc, ct = _load("corpus_carry"), _load("corpus")
    man = json.loads((carry / "drafter-carry.json").read_text())
    f = read_gguf(SHIPPED / "muse-glimmer-micro-q8_0.gguf")
    try:
        tok = Tokenizer.from_gguf(f)
        hf = ct.tokenizer_from_vocab(list(f.get("tokenizer.ggml.tokens")), list(f.get("tokenizer.ggml.merges")))
    finally:
        f.close()
    docs = cc.read_shard(carry, man["shards"]["train"])
    stream = torch.from_numpy(cc.encode(hf, docs).astype(np.int64))
    return td.TrainPrompts(stream, tok.bos_id, man["line_end_ids"]), tok, docs


def test_train_prompts_follow_the_bench_rules(td, train_prompts):
    """File starts are the bench's natural rule (spec.start_prompts) on train files, mid-file prompts end
    at the bench's line boundaries (spec.ends_line) inside one train file, and neither reaches the
    held-out split (the carried train shard is all TrainPrompts sees)."""
    from muser import corpus
    from muser.bench.kinds.spec import ends_line, start_prompts

    tp, tok, docs = train_prompts
    assert tp.doc_start.numel() == len(docs) and tp.cut_end.numel() > 100_000
    train = {d.relpath: d for d in corpus.split_docs(corpus.load_docs(), "train")}
    held = {d.relpath for d in corpus.split_docs(corpus.load_docs(), "heldout")}
    assert {r for r, _ in docs} <= train.keys() and not {r for r, _ in docs} & held
    cfg = td.DistillConfig(prompt_min=40, prompt_max=40)
    gen = torch.Generator().manual_seed(5)
    p, starts = tp.draw("start", cfg, 2048, gen)
    bench = [ids for _, ids in start_prompts(tok, [train[r] for r, _ in docs], None, p - 1)]
    assert p == 40 and len(bench) > 700 and sorted(starts.tolist()) == sorted(bench)  # each train file once
    p, mids = tp.draw("mid", cfg, 64, gen)
    assert mids.shape == (64, 40) and len({tuple(x) for x in mids.tolist()}) == 64
    for x in mids.tolist():
        assert x[0] == tok.bos_id and ends_line(tok, x[-1]) and tok.bos_id not in x[1:]
        text = tok.decode_bytes(x[1:])
        assert any(text in d for _, d in docs)  # a window of one train file
    longest = int((tp.doc_end - tp.doc_start).max()) + 2  # no file holds a prompt this long
    p, win = tp.draw("start", td.DistillConfig(prompt_min=longest, prompt_max=longest), 4, gen)
    assert p == longest and win.shape == (4, longest)  # nothing eligible: windows at random offsets


def test_train_prompts_are_deterministic(td, train_prompts):
    tp = train_prompts[0]
    cfg = td.DistillConfig()

    def groups(seed):
        gen = torch.Generator().manual_seed(seed)
        return [tp.draw_group(cfg, 256, gen) for _ in range(6)]

    a, b = groups(3), groups(3)
    assert [(c, p) for c, p, _ in a] == [(c, p) for c, p, _ in b] and all(torch.equal(x[2], y[2]) for x, y in zip(a, b))
    assert {c for c, _, _ in a + groups(4) + groups(5)} >= {"start", "mid"}
    assert [x[2].tolist() for x in a] != [x[2].tolist() for x in groups(4)]


def test_row_target_logits_are_the_labels_distributions(td):
    """The distillation target of row j of the block at anchor n is the target's logits at position
    n + j - 1, the ones whose argmax is the row's greedy label."""
    g, m, stream = _tiny_target()
    ids = m.greedy(stream[:12].view(2, 6), 30)
    feats, last = td.target_features(m, [1, 4, 7], ids, final=True)
    assert torch.equal(feats, td.target_features(m, [1, 4, 7], ids))
    anchors = torch.tensor([[5, 9], [6, 14]])
    rows = td.row_target_logits(m, last, anchors, 16)
    with torch.no_grad():
        full = m(ids)
    for b in range(2):
        for a in range(2):
            n = int(anchors[b, a])
            assert torch.allclose(rows[b, a, 1:], full[b, n:n + 15], atol=1e-4)
            assert rows[b, a, 1:].argmax(-1).tolist() == ids[b, n + 1:n + 16].tolist()


@pytest.fixture(scope="module")
def smoke_out(td, carry, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter-out")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = td.main(["distill-device", "--target", str(SHIPPED / "muse-glimmer-micro-q8_0.gguf"), "--carry",
                      str(carry), "--out", str(out), "--baseline", str(SHIPPED / "muse-glimmer-micro-dflash.gguf"),
                      "--smoke"])
    finally:
        torch.set_num_threads(threads)
        td.STOP["why"] = None
    assert rc == 0
    return out


def test_smoke_run_records_and_exports(td, smoke_out, tmp_path):
    from muser.model.loader import open_model
    from muser.spec.drafter import check_pair

    files = sorted(p.name for p in smoke_out.iterdir())
    assert files == ["drafter-run.json", "drafter-weights.npz"]
    run = json.loads((smoke_out / "drafter-run.json").read_text())
    rec = run["drafter"]
    assert run["status"] == "done" and rec["status"] == "done" and rec["steps"] == 3
    assert rec["target"]["artifact_sha256"] == json.loads(
        (SHIPPED / "muse-glimmer-micro-q8_0.pin.json").read_text())["artifact_sha256"]
    assert rec["gen"]["train_sequences"] == 8 and rec["gen"]["heldout_sequences"] == 4
    for name in ("heldout_gen", "train_gen_unseen", "train_gen_pool"):
        ev = rec["eval"][name]
        assert ev["blocks"] == 4 * (24 - 16 + 2) and 0.0 <= ev["top1_row1"] <= 1.0  # anchors p-1 .. T-16
        assert ev["mean_accepted_7"] <= ev["mean_accepted_15"] <= 15 and len(ev["top1_by_row"]) == 15
    assert rec["baseline"]["heldout_gen"]["blocks"] == rec["eval"]["heldout_gen"]["blocks"]
    assert rec["gen"]["class_sequences"]["start"] + rec["gen"]["class_sequences"]["mid"] == 8
    assert rec["gen"]["bench_heldout_prompts"] == {"natural": 2, "natural-mid": 2, "synthetic": 1}
    for side in (rec["eval"], rec["baseline"]):
        b = side["bench_heldout"]
        assert b["natural"]["first_prompts"] == ["asynchat.py", "chunk.py"] and b["natural"]["rounds_7"] > 0
        for cls in ("natural", "natural-mid", "synthetic"):
            assert 0.0 <= b[cls]["per_round_accepted_of_7"] <= 7 and 0.0 <= b[cls]["per_round_accepted_of_15"] <= 15
        assert 0.0 <= side["heldout_gen"]["expected_accepted_7_t0.7"] <= 7
    assert run["data"]["bench_heldout"]["prompts"]["natural"] > 50
    assert run["data"]["shards"]["train"]["tokens"] > 1_000_000
    with np.load(smoke_out / "drafter-weights.npz") as z:
        assert {z[k].dtype for k in z.files if z[k].ndim == 2} == {np.dtype("float16")}
    out = tmp_path / "d.gguf"
    target = SHIPPED / "muse-glimmer-micro-q8_0.gguf"
    assert td.export(smoke_out, target, out) == 0
    mf = open_model(target, pin=target.with_name("muse-glimmer-micro-q8_0.pin.json"))
    try:
        f, cfg, _ = check_pair(out, mf)  # the sidecar fits the shipped target (width, layers, vocabulary)
        prov = json.loads(f.get("muser.drafter.provenance"))
        f.close()
    finally:
        mf.close()
    assert list(cfg.target_layers) == [1, 4, 7]
    assert prov["target"]["artifact_sha256"] == rec["target"]["artifact_sha256"] and prov["steps"] == 3
    (smoke_out / "drafter-weights.npz").write_bytes(b"x" + (smoke_out / "drafter-weights.npz").read_bytes()[1:])
    with pytest.raises(SystemExit, match="sha256"):
        td.export(smoke_out, target, tmp_path / "e.gguf")


def _tiny_target():
    """A random smoke-geometry target and a token stream for it."""
    mn = _load("micro_net")
    g = mn.Geometry(vocab=64, **mn.SMOKE)
    m = mn.MicroGlimmer(g)
    m.reset(2)
    return g, m, torch.randint(6, 64, (4096,), generator=torch.Generator().manual_seed(1))


def test_sigterm_before_generation_trains_and_keeps_nothing(td):
    g, m, stream = _tiny_target()
    kept = []
    td.STOP["why"] = "signal 15"
    try:
        arrs, rec = td.distill(m, g, stream, stream, 3, 1e4, smoke=True, log=lambda *_: None,
                               on_trained=kept.append)
    finally:
        td.STOP["why"] = None
    assert rec["status"] == "stopped during generation (signal 15)" and arrs == {} and kept == []


def test_distill_trains_a_tiny_target(td):
    """A smoke distillation of a random 8-layer target: the drafter's geometry follows the target's, the
    weights arrive through on_trained before the evaluation, and every count in the record adds up."""
    g, m, stream = _tiny_target()
    kept = []
    arrs, rec = td.distill(m, g, stream, stream, 3, 1e4, smoke=True, log=lambda *_: None, on_trained=kept.append)
    assert rec["status"] == "done" and rec["steps"] == 3 and kept and kept[0].keys() == arrs.keys()
    assert rec["draft"]["target_layers"] == [1, 4, 7] and rec["draft"]["ffn"] == g.ffn
    assert arrs["fc.weight"].shape == (g.hidden, 3 * g.hidden)
    assert rec["n_params"] == sum(a.size for a in arrs.values())
    assert rec["blocks_seen"] == 3 * rec["config"]["batch"] * rec["config"]["anchors"]
    assert rec["gen"]["prompt_lengths"] and all(8 <= p <= 24 for p in rec["gen"]["prompt_lengths"])


def test_training_blocks_propose_what_the_runtime_proposes(td, export_mod):
    """The training graph (tools/micro_net.py features, draft_blocks) against Muser's runtime (engine
    captures, muser.spec.Drafter.propose) on the shipped pair, first round after a held-out prompt: the
    same 15 proposals (the features differ only by Q8_0 activation rounding)."""
    import muser
    from muser.gguf.reader import read_gguf
    from muser.text import Tokenizer

    path, draft = SHIPPED / "muse-glimmer-micro-q8_0.gguf", SHIPPED / "muse-glimmer-micro-dflash.gguf"
    f = read_gguf(path)
    try:
        tok = Tokenizer.from_gguf(f)
    finally:
        f.close()
    ids = [0] + tok.encode(export_mod.prompt_text("secrets.py", 34), add_special=False)
    m = muser.load(path, device="cpu")
    try:
        s = m.spec_session(draft, max_context=512)
        x = int(np.argmax(np.asarray(s.prefill(ids))[-1]))
        runtime = s.d.propose(s.ctx, x, 15)
    finally:
        m.close()
    target, facts, D, ng, W = td.training_pair(path, draft, "cpu")
    full = torch.tensor([ids + [x] + [facts["ids"]["mask"]] * 15])  # positions after n are never read
    with torch.no_grad():
        ctx = td.drafter_context(W, ng, target, D["target_layers"], full)
        logits, labels = td.draft_blocks(W, ng, target, ctx, full, torch.tensor([[len(ids)]]), 3, 16)
    assert int(labels[0, 0, 0]) == x
    assert logits[0, 0, 1:].argmax(-1).tolist() == runtime


def test_round_lengths_follow_the_commit_rule(td):
    # no acceptance, 5 tokens: rounds at the 1st..4th token, the 4th still open when the 5th is out
    assert td.round_lengths([0] * 8, 5, 7) == [0, 0, 0]
    # a full round is committed once its 7th draft is decoded; the bonus then opens the next round
    assert td.round_lengths([7] + [0] * 16, 10, 7) == [7]  # the bonus (9th) opens a round the 10th leaves open
    assert td.round_lengths([7] + [0] * 16, 11, 7) == [7, 0]
    assert td.round_lengths([7] + [0] * 16, 8, 7) == []  # the 7th draft is the 8th token: not decoded


def test_training_rounds_are_the_runtime_rounds(td):
    """The bench's first natural prompt on the shipped pair: the greedy rounds the training code implies
    (anchor_hits + round_lengths, every block seeing the whole true prefix) are the rounds Muser's
    speculative session commits with every round drafting (incremental verify-row injection, rollbacks)."""
    import muser
    from muser.bench.kinds.spec import natural_prompts
    from muser.sample import SamplingParams
    from muser.spec import AcceptanceGate

    path, draft = SHIPPED / "muse-glimmer-micro-q8_0.gguf", SHIPPED / "muse-glimmer-micro-dflash.gguf"
    n_new = 32
    m = muser.load(path, device="cpu")
    try:
        (_, ids), = natural_prompts(m, 1, 256, None)
        g = m.stream(ids, n_new, sampling=SamplingParams(temperature=0.0), draft=str(draft), verify_len=7,
                     gate=AcceptanceGate(close_below=0.0))
        toks = [e.token for e in g]
        runtime = g.spec.accepted_lengths
    finally:
        m.close()
    target, facts, D, ng, W = td.training_pair(path, draft, "cpu")
    K = D["block_size"]
    seqs = target.greedy(torch.tensor([ids]), n_new + K)
    assert seqs[0, len(ids):len(ids) + n_new].tolist() == toks
    run = td.anchor_hits(W, ng, target, D["target_layers"], seqs, len(ids), n_new + 1, facts["ids"]["mask"], K)
    acc = run[0, :, :7].int().cumprod(-1).sum(-1)
    assert len(runtime) > 10 and td.round_lengths(acc[1:].tolist(), n_new, 7) == runtime
