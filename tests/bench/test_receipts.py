"""Receipts come only from the writer (muser.bench.receipt): every file under bench/receipts/ is
one it could have produced, unedited; and the writer refuses what a receipt must never say."""

from __future__ import annotations

import json

import pytest

from muser.bench import receipt as R
from muser.errors import ReceiptError

# Genuine receipts written before the writer's stamp and digest, frozen by the SHA-256 of their
# bytes: any edit turns this test red. New receipts carry their own digest instead.
LEGACY = {
    "20261129T091302Z-quant.json": "c74d92f4850fa73305f9ddfd4e2ffd9515e1462863e46cf310789071d423abae",
    "20261129T095706Z-ppl.json": "f7943d31cb2c378e5096a4acc06e7c16c82e7eef93a6a34f5d94d25a47fe1ce0",
    "20261130T153311Z-ppl.json": "fa18fb21577ca5c757d879431a5eba6ab40e090a7b9277d2d61cd23579ff3723",
    "20261130T153431Z-parity.json": "dffce816de8293c88ad9344fa2927cbf400e97ad30d6e0c6309642cf5df37a74",
    "20261130T153443Z-parity.json": "314eb3dc7fef715f144788af703e0a91f1833958136fe7e64bd3fd6fe5ee1fde",
    "20261130T153457Z-parity.json": "f910eac0b30136d78362eba8b704125c39091dc137a91ca2a7c1ce6ddc358485",
    "20261130T153513Z-parity.json": "54872c82cb4d1def0b6b3cea1f99d6f87e14e813b71c042f2d758d9d084a1dad",
    "20261130T153529Z-parity.json": "d08cc5ec351c72aee4446f518d033ba9403ee3f84a25eae566ff5dd96c07fa59",
    "20261130T153544Z-parity.json": "3e0961897f409fd36442c6541705e766715ce7bab940ca2705ff04e6cb98d100",
    "20261130T153601Z-parity.json": "ea76c003a051b0b887c3e7edcb7db08c3dac8f0c951212accb6e58494a19dac3",
    "20261130T153620Z-parity.json": "f67e7172316f2382ba11495c9bef74947f3540230538182d17abb46ed906218f",
    "20261130T153638Z-parity.json": "e960b24ef882c8ccb565b304d3c169f39b64c7345a47a93d9b3700d460cc94b2",
    "20261130T153658Z-parity.json": "dc4b8886b62a623c3baa8f481da7907a28e8868f3710a22331ab7729e992bf89",
    "20261130T153705Z-ppl.json": "d310571cffcf8aabbc2943b87e172c30179b6f291064d5c6d996fe2901ca70e0",
    "20261130T153715Z-parity.json": "f7b5d443449c37cbda71da6fd676cf748e6d676dad6a7754e4b4bd89d206d9f7",
    "20261130T153731Z-parity.json": "4133ec982e8e457f604e176e60397fe10c0b9ec2bdcd9f24c57ea7fc1aad5ef4",
    "20261130T153746Z-parity.json": "6c4bab6521976a6ee2d7877f59a31a2b676d38e3c87481dfa6d4407900222b2c",
    "20261130T153802Z-parity.json": "5418197dcfdc1bc7b4429f0e279c1e724b92d0334df51baaa4892a134c95742d",
    "20261130T153820Z-parity.json": "d9c7b927547e1afac1e65e4420318321a8746483a971b4c74f1b6c8ba35b2942",
    "20261130T153838Z-parity.json": "48d1e08d6bd66364aff00d9a4a86ca207f1e4e3d982a405b3da26b2723970427",
    "20261130T153859Z-parity.json": "0fefec4fd6f4b0b703770abd9d6c8c7e49fbcf0463c9b0e0441451a2438a3eef",
    "20261130T154000Z-oracle.json": "88746b0925a50012a7b067eb216e636cbc2a23bcc3727f81ff8a131375e1da03",
    "20261130T154055Z-ppl.json": "5c6b072bddf0550f956d6cb98d48303a352fb3a56d72f68485007a33979db41c",
    "20261130T154217Z-parity.json": "a11d87214bbc9b1f9578c3779ec8d1a2d61bcfd5f4fe4f207543fc167b7ed1ee",
    "20261130T154236Z-parity.json": "0e90f8a66fa171b7dc0c90cccea81e57eab84e03f0ece510b9ef136ff53ab80d",
    "20261130T154255Z-parity.json": "e80a83f4cdebf4240bf32a43b9fac3f6b3ef0c71c7b35758bcb19d4ed184e783",
    "20261130T154312Z-parity.json": "73cea42427fa100468e712099895037d2628b5526eec8f3fd449d4b6e4c4f9f7",
    "20261130T154327Z-parity.json": "71e9bbdd75ba51b3aa8e3fad51a8429e49c0fe448a5a75cc15ec6826e23fbe29",
    "20261130T154343Z-parity.json": "65640215fe304a8cb1414f214d1ce5ed16216eba81e238c7c74af12340964dd1",
    "20261130T154358Z-parity.json": "2e172146c539408304e8ae52b828aa7bad64f6f27f192efd392d26b996908001",
    "20261130T154412Z-parity.json": "4215f9891963effaf34496cc17882818281d642539e63a40469386ac10c4d9dc",
    "20261130T154428Z-parity.json": "736702f6c3949d0a519a50833fc36d0deb6ceb752569277aa3742d7074f1371f",
    "20261130T154444Z-parity.json": "8c0db9c2f343d6de1a822f6917d16c4e2937fc42ef373cf6f8203d919423413d",
    "20261130T154458Z-parity.json": "64e7f7648512389f24e54139ff6145c03671949b75eea61982a194baf068419c",
    "20261130T154510Z-parity.json": "37ba42435a3424ca1330ccd4248ac1695d48183f6e3a0e1b34b0118cdc0bae52",
    "20261130T154523Z-parity.json": "69aeb974a49271e4f25451c811f565e56109f1736974bf97104199af182776f1",
    "20261130T154537Z-parity.json": "a836e6067375e10179b6b2c4d568f835e0327db75d698b36be834c36d7d067fe",
    "20261130T154545Z-ppl.json": "40df521785f271697220d9a7bf1623d4c91ba51396484123427b4134b3e3d22e",
    "20261130T154552Z-parity.json": "350b020df2714ae985570771fe13c4c0a34a3f2180faaf21ddff72692e78c304",
    "20261130T154608Z-parity.json": "e0e4ace2479c6c9ee0e1c329c161b768b09546f14896686649b2da86471bf919",
    "20261130T154623Z-parity.json": "0c4afa43e01c1ed645a1b6a1d0b17557f6eb8b57d6927d331a0ef0b25d67e163",
    "20261130T154654Z-parity.json": "bb4a8b9b2be045e972d772f81e92f5ddd6fdf996424887bd1b42983110b02d15",
    "20261130T154712Z-parity.json": "1059bd449aaf35cffcec7c0ab462068d2e044d484a42feb05fd221031e6405c1",
    "20261130T154720Z-tokenizer.json": "42d5753ea7a0d86ba87e470cd2f7164de03d301a6b07775c4c1ae537a0976baf",
    "20261130T154729Z-parity.json": "68ec92b0f581799a12e35ba12d4ab70bc51124198805d67b5e28b9825878a436",
    "20261130T154751Z-parity.json": "599df4ff6962e288ab668b4cc84fc80bdfcc5b6cfbb8c45842ae7f5b62036a62",
    "20261130T154810Z-parity.json": "442f628759c794e57c7fb2ab9805537a20521dab460dff857302865a6faf406c",
    "20261130T154833Z-parity.json": "f66620472c1e2de8630740a3afa2fad78fb6d54c52a355cb13bfe326eb84ab94",
    "20261130T154855Z-parity.json": "0ec397dd7c86e6c56df21f99b0167e05cc8b3b3d458a67659893fd7048072f22",
    "20261130T154913Z-verify.json": "47c87cfab1e4970c3307f49b52057d59cb7257b26b4260b9a62a4d153ac1106f",
    "20261130T154925Z-prefill.json": "31173719c4c53b2e6ff51d0242ac049ccd2f451163d3c2644df9decbc44ec2ee",
    "20261130T154940Z-decode.json": "6e31bd753ec7ded286e414368d0d9168d1285d5c3c0d727d177ee44d2604440a",
    "20261130T154948Z-ppl.json": "300f388694078dbd6d308f00780cafeb79fc426d9eb3efc5605d52bba1b085d9",
    "20261130T154953Z-prefill.json": "bdc968040d48aa0b946cfb7232719b69104fc4db9887c72445893c7ce9ac636c",
    "20261130T155027Z-decode.json": "f274aecd3e0049447bd34efe4d70436e24043757f1e57a79f2b25ad19bc69468",
    "20261130T155318Z-ppl.json": "c04b3636b6af6c2a256a3d6a795acf7f5cc5466f73da0e50ba9aaebe0ddb27a3",
    "20261130T161749Z-decode.json": "57400a24ec482efe965b982c6cc2c31ef630d9d9faf16fb7281c647dfb47f94f",
    "20261130T161758Z-prefill.json": "8bc3bfda94f219b3868f9e4d6313558b054ba093511183d1f438353128ffe732",
    "20261130T163301Z-engine-gate2-cpu.json": "e6b1507791e57fd4c9d12070ac750bc6cfa0337bc389ec234f70515e11aae48e",
    "20261201T070127Z-handoff.json": "37674b5a7fdc49d32824eff77e6ff7de6cfda7b405c55d9298a214335c016518",
    "20261201T070151Z-serve.json": "e9894dc5ef31bb4559222eda94ac59adbc3262f4319f0b899e59cf8cd019f9ab",
    "20261201T070539Z-serve.json": "9b4f0f0720b22c5a8e10b08f6b2460e7deb696c727672124d261efe833948fc7",
    "20261201T071406Z-handoff.json": "808dbc8eaed919e7c3330d4067d2434ca02ed1e881fcabe6aff20ca9ba140ba6",
    "20261201T071925Z-handoff.json": "79055c5ca7fadff69cc3f9874aa899f523fdedf1212dc2730cd0af656ff9b606",
    "20261201T070347Z-kvpack.json": "a385c25d8ff8f935e6c7b6cb5af99c59bb00221c7630da2af28c2bc4312def88",
    "20261201T071212Z-decode.json": "e7d47ca95b10615c40bde1b864c0ffc1c3f8f84cecbd63207d614350630f2c1f",
    "20261201T071431Z-decode.json": "b639b20ed70daaad64aed136bdb5657d31bf162806adb6eafcebe8b249d2d5bd",
    "20261201T071640Z-kvpack.json": "1051f2bdaf01f7f5a488789265029124ced8d467c9ac5ec0942ea47cb91ef0c9",
    "20261201T072732Z-decode.json": "786c21ad9cf9af682121a9efd36f4f9ea8e684cf8d70fb1e9d46e5898894c552",
    "20261201T073111Z-decode.json": "68f2bb7739dcfa1b936d596105ec9775ec4d6568cd0d7bf3ab58dc685081d342",
    "20261201T071834Z-spec.json": "d16665b9b90a06f564db5700ba3c9e9336fc272688b8eeca299c87bbf5e10c47",
    "20261201T072811Z-ppl.json": "0cd3d772c26f4379dade54db668b04eb88cf841ce6b123ca14aebeef72c49244",
    "20261201T073019Z-ppl.json": "b6538f4e4ca6330c416aeeb079c76721865c29d6e882dcf17b7dd5730ab8a4f2",
    "20261201T073221Z-ppl.json": "b115a3efe499fb4ea18b2db2a7488df2edf68e9b4b54fa917a0673d47984b0f5",
    "20261201T073420Z-ppl.json": "912a109fa27e14bfd96f16fdea2f87f37bc8022a241f0f9dd659270fe9aedf89",
}


def test_every_receipt_is_one_the_writer_could_have_written():
    files = sorted(R.REPO_RECEIPTS.glob("*.json"))
    assert files, R.REPO_RECEIPTS
    bad = {p.name: why for p in files if (why := R.verify_receipt(p, LEGACY))}
    assert not bad, json.dumps(bad, indent=1)
    # beside the receipts: RETIRED.md and each receipt's plot (same name, .png), nothing else
    stray = sorted(p.name for p in R.REPO_RECEIPTS.iterdir() if p.suffix != ".json" and p.name != "RETIRED.md"
                   and not (p.suffix == ".png" and p.with_suffix(".json").is_file()))
    assert not stray, stray


def test_retired_receipts_are_gone_and_listed():
    text = (R.REPO_RECEIPTS / "RETIRED.md").read_text()
    listed = [line.split("`")[1] for line in text.splitlines() if line.startswith("| `")]
    assert len(listed) >= 10
    for name in listed:
        assert not (R.REPO_RECEIPTS / name).exists(), name
        assert name not in LEGACY


def _write(tmp_path, gate, **kw):
    return R.write_receipt("parity", model={"sha256": "0" * 64}, device=R.device_description("cpu"), lane="exact",
                           gate=gate, results={"max": 1e-5}, command=["muser", "bench", "parity"],
                           out_dir=tmp_path, **kw)


def test_a_written_receipt_verifies_and_an_edit_does_not(tmp_path):
    p = _write(tmp_path, {"status": "pass", "max": 1e-5, "bound": 1e-4})
    body = json.loads(p.read_text())
    assert body["writer"] == R.WRITER and body["digest"] == R.digest(body)
    assert R.verify_receipt(p) == []
    body["results"]["max"] = 2e-5  # an after-the-fact edit
    p.write_text(json.dumps(body, indent=2) + "\n")
    assert any("digest" in w for w in R.verify_receipt(p))
    # and a frozen legacy file that changes is caught by its hash
    assert any("legacy" in w for w in R.verify_receipt(p, {p.name: "0" * 64}))


def test_receipts_are_never_overwritten(tmp_path):
    a = _write(tmp_path, {"status": "n/a"})
    b = _write(tmp_path, {"status": "n/a"})
    assert a != b and a.exists() and b.exists()
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("gate, what", [
    ({"status": "pass"}, "no measured evidence"),
    ({"status": "pass", "what": "Gate 2", "rule": "max <= 1e-4"}, "no measured evidence"),
    ({"status": "pass", "receipt": "other.json"}, "not copied"),
    ({"status": "pass", "max": 1e-5, "gated_by": "other.json"}, "gated_by"),
    ({"status": "pass", "max": 1e-5, "skipped": ["kv=f16"]}, "partial"),
    ({"status": "ok", "max": 1e-5}, "must be one of"),
])
def test_the_writer_refuses_a_pass_it_did_not_measure(tmp_path, gate, what):
    with pytest.raises(ReceiptError, match=what):
        _write(tmp_path, gate)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_partial_and_gated_by_are_accepted(tmp_path):
    assert R.verify_receipt(_write(tmp_path, {"status": "partial", "max": 1e-5, "skipped": ["kv=f16"]})) == []
    assert R.verify_receipt(_write(tmp_path, {"status": "n/a", "gated_by": "x.json", "gated_by_status": "pass"})) == []


def test_the_writer_refuses_hand_made_envelopes(tmp_path):
    with pytest.raises(ReceiptError, match="shell variable"):
        R.write_receipt("decode", model=None, device={}, lane=None, gate={"status": "n/a"}, results={},
                        command=["tools/x.py", "--out", "$OUT"], out_dir=tmp_path)
    with pytest.raises(ReceiptError, match="envelope"):
        R.write_receipt("decode", model=None, device={}, lane=None, gate={"status": "n/a"}, results={},
                        command=["x"], out_dir=tmp_path, extra={"git_sha": "HEAD"})
    assert not list(tmp_path.iterdir())


def test_verify_names_what_a_hand_made_receipt_gets_wrong(tmp_path):
    p = _write(tmp_path, {"status": "n/a"})
    body = json.loads(p.read_text())
    body |= {"git_sha": "HEAD", "command": ["x", "--out", "$OUT"], "gate": {"status": "pass", "receipt": "y.json"}}
    body["digest"] = R.digest(body)  # even with a recomputed digest
    q = tmp_path / "20200101T000000Z-decode.json"
    q.write_text(json.dumps(body))
    why = " | ".join(R.verify_receipt(q))
    for frag in ("git_sha 'HEAD'", "shell variable", "file name", "not copied"):
        assert frag in why, why
    (tmp_path / "20200101T000001Z-decode.json").write_text(json.dumps({"command": "x", "rows": []}))
    assert "no envelope" in R.verify_receipt(tmp_path / "20200101T000001Z-decode.json")[0]


@pytest.mark.parametrize("sent", ["1319bb1", "unknown", "939F263FC7C419ED311D385E7515298D9BF78BF4", "x" * 40])
def test_an_abbreviated_or_malformed_sent_sha_is_refused_before_writing(tmp_path, monkeypatch, sent):
    monkeypatch.setenv("MUSER_GIT_SHA", sent)
    with pytest.raises(ReceiptError, match="MUSER_GIT_SHA"):
        _write(tmp_path, {"status": "n/a"})
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_a_full_sent_sha_is_stamped_and_verifies(tmp_path, monkeypatch):
    sha = "939f263fc7c419ed311d385e7515298d9bf78bf4"
    monkeypatch.setenv("MUSER_GIT_SHA", sha)
    p = _write(tmp_path, {"status": "n/a"})
    assert json.loads(p.read_text())["git_sha"] == sha and R.verify_receipt(p) == []
