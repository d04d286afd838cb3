"""Shared fixtures: synthetic Muse Glimmer GGUFs written once per test session and cached by spec."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from muser.model.synth import SynthSpec, write_fixture


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-fixtures")


@pytest.fixture(scope="session")
def make_gguf(fixture_dir):
    """make_gguf(spec=SynthSpec(...), **write_fixture_kwargs) -> Path, cached per session."""
    cache: dict[str, Path] = {}

    def make(spec: SynthSpec = SynthSpec(), **kw) -> Path:
        key = hashlib.sha256(
            json.dumps([asdict(spec), repr(sorted(kw.items()))], sort_keys=True, default=str).encode()
        ).hexdigest()[:16]
        if key not in cache:
            cache[key] = write_fixture(fixture_dir / f"synth-{key}.gguf", spec, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_gguf(make_gguf) -> Path:
    """The default tiny fixture: 4 layers (one collar), hidden 512, head_dim 32, F32, window 32."""
    return make_gguf(SynthSpec())
