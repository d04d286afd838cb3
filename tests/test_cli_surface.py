"""CLI conveniences and docs: --version, prompt sources (--prompt-file, '-'), --echo, --threads,
choices refused before torch loads, the default prompt, `inspect --check`, receipts out of the
repository by default, `make run` without the test extra, the README's Python example, help(muser)."""

from __future__ import annotations

import io
import json
import pydoc
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import muser
from muser.cli import main
from muser.gguf.reader import read_gguf
from muser.model.synth import SynthSpec
from muser.prompt import DEFAULT_PROMPT
from muser.text import Tokenizer

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"muser {muser.__version__}"


def test_prompt_file_stdin_and_echo(tiny_gguf, tmp_path, capsys, monkeypatch):
    tok = Tokenizer.from_gguf(read_gguf(tiny_gguf))
    f = tmp_path / "p.txt"
    f.write_text("import json\n", encoding="utf-8")
    base = ["generate", "--model", str(tiny_gguf), "--max-tokens", "2", "--temperature", "0"]
    assert main(base + ["--prompt-file", str(f), "--json"]) == 0
    assert _summary(capsys)["prompt_ids"] == tok.encode("import json\n", add_special=True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("from os import path\n"))
    assert main(base + ["--prompt", "-", "--json"]) == 0
    assert _summary(capsys)["prompt_ids"] == tok.encode("from os import path\n", add_special=True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("x = 1\n"))
    assert main(base + ["--prompt-file", "-", "--echo"]) == 0
    assert capsys.readouterr().out.startswith("x = 1\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(base + ["--prompt", "-"]) == 2
    assert "empty" in capsys.readouterr().err


def test_threads(tiny_gguf, capsys):
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["generate", "--model", str(tiny_gguf), "--prompt", "x", "--max-tokens", "1",
                     "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_gguf), "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_choices_are_refused_before_torch_is_imported(tmp_path):
    code = ("import sys\nfrom muser.cli import main\n"
            "try:\n    main(['generate', '--device', 'tpu'])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert r.stdout.split() == ["2", "False"], r.stderr
    assert "invalid choice: 'tpu'" in r.stderr


def test_cli_choices_are_the_engines():
    from muser.commands import generate as g
    from muser.engine.lanes import DEVICES, KV_TYPES, Lane

    assert g.DEVICES == DEVICES and g.KV_TYPES == KV_TYPES and g.LANES == tuple(x.value for x in Lane)


def test_a_lane_not_named_is_the_devices_default(make_gguf, capsys):
    from muser.cli import build_parser
    from muser.engine import Engine
    from muser.engine.lanes import DEFAULT_LANES, default_lane, resolve_lane
    from muser.errors import LaneError

    assert DEFAULT_LANES == {"cpu": "exact", "cuda": "fast"} and set(DEFAULT_LANES) == set(muser.engine.lanes.DEVICES)
    assert default_lane("cuda") == "fast" and resolve_lane(None, "cpu") == "exact" and resolve_lane("fast", "cpu") == "fast"
    with pytest.raises(LaneError, match="'tpu'"):
        default_lane("tpu")
    for cmd in (["generate"], ["chat"], ["serve"], ["prefill-node", "--listen", "127.0.0.1:0", "--certs", "x"]):
        assert build_parser().parse_args(cmd).lane is None, cmd  # the device decides, at load
    src = make_gguf(SynthSpec(dtype="Q8_0"))
    assert muser.load(src).lane == "exact" and muser.load(src, lane="fast").lane == "fast"
    assert Engine.open(src).lane.value == "exact"
    with pytest.raises(LaneError, match="'bogus'"):
        muser.load(src, lane="bogus")
    assert main(["generate", "--model", str(src), "--max-tokens", "2", "--json", "--prompt", "x"]) == 0
    assert _summary(capsys)["lane"] == "exact"  # the lane that ran, not the flag's None


def test_default_prompt_starts_python_code():
    compile(DEFAULT_PROMPT + "    pass\n", "<default prompt>", "exec")
    assert not DEFAULT_PROMPT.lstrip().startswith(('"""', "'''")) and DEFAULT_PROMPT.count('"""') == 0


def test_inspect_check_finds_a_nan_q8_0_scale(make_gguf, tmp_path, capsys):
    src = make_gguf(SynthSpec(dtype="Q8_0"))
    assert main(["inspect", str(src), "--check", "--no-hash", "--json"]) == 0
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert d["verdict"] == "valid" and d["checked"]["problems"] == [] and "check" in err
    assert d["checked"]["engine"] == "all"
    bad = tmp_path / "nan-scale.gguf"
    shutil.copyfile(src, bad)
    name = "blk.1.ffn_down.weight"
    t = read_gguf(src).tensors[name]
    with open(bad, "r+b") as fh:
        fh.seek(t.offset + 3 * 34)  # block 3's f16 d (block_q8_0: d, then 32 int8)
        fh.write(np.array([np.nan], dtype=np.float16).tobytes())
    assert main(["inspect", str(bad), "--no-hash", "--json"]) == 0  # the contract alone does not see it
    assert json.loads(capsys.readouterr().out)["verdict"] == "valid"
    assert main(["inspect", str(bad), "--check", "--no-hash"]) == 1
    out = capsys.readouterr().out
    assert "verdict         invalid" in out and name in out and "block 3" in out


def test_bench_receipts_go_to_the_user_cache(tmp_path, monkeypatch):
    from muser.bench.receipt import write_receipt

    monkeypatch.delenv("MUSER_RECEIPTS", raising=False)
    monkeypatch.setenv("MUSER_CACHE", str(tmp_path / "cache"))
    p = write_receipt("probe", model=None, device={}, lane=None, gate={"status": "n/a"}, results={})
    assert p.parent == tmp_path / "cache" / "receipts"
    q = write_receipt("probe", model=None, device={}, lane=None, gate={"status": "n/a"}, results={},
                      out_dir=tmp_path / "evidence")
    assert q.parent == tmp_path / "evidence"


def test_make_run_installs_only_the_runtime():
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    r = subprocess.run(["make", "-n", "-B", "run"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install -q -e ." in r.stdout and "[test]" not in r.stdout and "llama-cpp" not in r.stdout
    r = subprocess.run(["make", "-n", "-B", "test"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "'.[test]'" in r.stdout


def test_readme_python_example_runs():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert r.returncode == 0, r.stderr[-2000:]


def test_help_lists_the_public_names():
    doc = pydoc.render_doc(muser, renderer=pydoc.plaintext)
    for name in muser.__all__:
        assert name in doc, name
        assert name in dir(muser)
        getattr(muser, name)


def test_inspect_check_says_the_engine_serves_an_nvfp4_file(tiny_gguf, tmp_path, capsys):
    from muser.quant.convert import convert

    out = tmp_path / "nvfp4.gguf"
    convert(tiny_gguf, out, "nvfp4")
    capsys.readouterr()
    assert main(["inspect", str(out), "--check", "--no-hash", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "valid" and d["checked"]["engine"] == "all"  # the engine decodes NVFP4 exactly
