"""Open a Muse Glimmer GGUF and validate it completely before any work: structure (reader),
metadata contract (MuseConfig), tensor contract, identity and pin."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..gguf.identity import Identity, check_pin, identity_of
from ..gguf.reader import GGUFFile, read_gguf
from .config import MuseConfig
from .contract import ContractReport, check_contract, parameter_count


@dataclass
class ModelFile:
    path: Path
    gguf: GGUFFile
    config: MuseConfig
    contract: ContractReport

    @cached_property
    def identity(self) -> Identity:
        return identity_of(self.gguf, self.config.eog_ids)

    @property
    def n_params(self) -> int:
        return parameter_count(self.config)

    def bytes_by_class(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, cls in self.contract.classes.items():
            out[cls.value] = out.get(cls.value, 0) + self.gguf.tensors[name].nbytes
        return out

    def weight_bytes_per_token(self) -> int:
        """Weight bytes one decoded token streams: every tensor once, but only one embedding row
        (book 6.6); NVFP4 companions included."""
        total = 0
        for t in self.gguf.tensors.values():
            if t.name == "token_embd.weight":
                total += t.row_bytes
            else:
                total += t.nbytes
        return total

    def close(self) -> None:
        self.gguf.close()


def open_model(path: str | os.PathLike, pin: str | os.PathLike | dict | None = None) -> ModelFile:
    """Read, validate and (if `pin` is given) identity-check a model file. Raises a MuserError
    subclass naming the offending value; nothing is loaded onto any device."""
    f = read_gguf(path)
    try:
        cfg = MuseConfig.from_gguf(f)
        report = check_contract(f, cfg)
        m = ModelFile(Path(path), f, cfg, report)
        if pin is not None:
            check_pin(m.identity, pin)
        return m
    except BaseException:
        f.close()
        raise
