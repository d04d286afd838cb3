"""Strict GGUF reading, writing helpers, identity and pins."""

from .reader import Field, GGUFFile, TensorInfo, ValueType, read_gguf
from .types import GgmlType, TypeInfo, type_info

__all__ = ["Field", "GGUFFile", "TensorInfo", "ValueType", "read_gguf", "GgmlType", "TypeInfo", "type_info"]
