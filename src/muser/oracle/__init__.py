"""`muser.oracle`: the numpy CPU reference, the bit-level spec (DESIGN.md).

    import muser
    m = muser.oracle.load(path, arithmetic="f32" | "ggml-cpu", kv="f16" | "f32", pin=None)
    s = m.session(max_context=4096)     # the engine's Session surface

session.py holds the loaded model and its sessions, forward.py the Figure 10.1 graph in numpy,
numerics.py one function per op and the two arithmetic modes.
"""

from ..sequence import SessionCheckpoint
from .session import (
    DEFAULT_CHUNK,
    DEFAULT_KV,
    NoiseFloor,
    OracleModel,
    OracleSession,
    load,
    noise_floor,
    parity_stats,
)

__all__ = ["DEFAULT_CHUNK", "DEFAULT_KV", "NoiseFloor", "OracleModel", "OracleSession", "SessionCheckpoint",
           "load", "noise_floor", "parity_stats"]
