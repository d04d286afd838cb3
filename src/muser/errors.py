"""Typed errors. Every refusal in Muser is one of these, and its message names the offending value.

The CLI prints ``str(err)`` on one line and exits non-zero; no traceback for bad input.
"""

from __future__ import annotations


class MuserError(Exception):
    """Base of every error Muser raises on purpose."""

    exit_code = 2


# --- files and metadata -------------------------------------------------------------------


class GGUFError(MuserError):
    """The file is not a well-formed GGUF (structure, bounds, types)."""


class GGUFTruncated(GGUFError):
    """A read would run past the end of the file."""


class GGUFLimitError(GGUFError):
    """A count or length is larger than the bytes left could ever hold."""


class MetadataError(MuserError):
    """A metadata key is missing, has the wrong type, or holds an invalid value."""


class MissingKey(MetadataError):
    pass


class WrongKeyType(MetadataError):
    pass


class ContractError(MuserError):
    """A tensor is missing, unknown, misshapen, or of a dtype not admitted for its class."""


class IdentityMismatch(MuserError):
    """A pin does not match the artifact; the message names the field and both values."""


class FormatError(MuserError):
    """Bad quantized data (NaN scale, pairing rule broken, unsupported conversion)."""


# --- runtime -------------------------------------------------------------------------------


class CacheDiscontinuity(MuserError):
    """A KV append at a position other than origin_logical + len (book 15.5)."""

    def __init__(self, layer: int, expected: int, got: int):
        self.layer, self.expected, self.got = layer, expected, got
        super().__init__(
            f"cache discontinuity at layer {layer}: expected position {expected}, got {got}"
        )


class ContextOverflow(MuserError):
    """A position at or past the session's max_context."""


class TokenOutOfRange(MuserError):
    """A token id outside [0, vocab)."""


class EmptyInput(MuserError):
    """No tokens where at least one is required."""


class NonFiniteLogits(MuserError):
    """NaN or infinite logits: no distribution is installed (book 10.9)."""


class LaneError(MuserError):
    """A device/lane/KV choice the engine cannot serve (exactly)."""


class SamplingError(MuserError):
    """An invalid sampling parameter."""


class TokenizerError(MuserError):
    """Tokenizer metadata the engine cannot honour exactly."""


class TemplateError(MuserError):
    """The chat template failed to render."""


class TemplateSecurityError(TemplateError):
    """The chat template tried to leave its sandbox or exceeded its bounds."""


class ComparatorError(MuserError):
    """The pinned llama.cpp comparator is unavailable or failed."""


class KvStateError(MuserError):
    """A KV checkpoint, snapshot or detached install that does not fit the live cache
    (expired checkpoint, geometry mismatch, incomplete install, rows of the wrong shape)."""


class BatchError(MuserError):
    """A step batch the engine cannot serve: a session from another engine or listed twice, a
    bad logits-row request, too many rows."""


class KvFormatError(KvStateError):
    """KV bytes that do not parse or verify (truncated, wrong magic or version, bad digest,
    inconsistent counts); `field` names the offending field."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(message)


class KvLayoutMismatch(KvStateError):
    """Well-formed KV bytes of another layout (layer kinds, KV type, heads, head_dim, window,
    chunk size); `field` names the layout key."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(message)


class HandoffRefused(MuserError):
    """A remote-KV handoff refused: authentication, integrity, replay, identity, schedule or
    link failure (book 10.7). Nothing from the refused stream reached a live plane."""


class ReceiptError(MuserError):
    """A receipt the writer refuses (or a file it could not have written)."""


class PlotError(MuserError):
    """A plot that cannot be drawn: a file that is not a receipt of a plotted kind, a missing
    figure, receipts of different kinds, a bad output path, or matplotlib not installed."""
