"""Reading one GGUF file: metadata with clear errors, tensors dequantized to float32.

Shared by the per-architecture importers (gguf_import for Llama, gguf_gemma3 for Gemma 3) and the
tokenizer builder, so each of them reads the file the same way. numpy and `gguf` only: no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

_Q = GGMLQuantizationType
# The types llama.cpp's usual quantizations (Q4_0 .. Q8_0, the K-quants of Q4_K_M / Q5_K_M / Q6_K)
# store; `gguf` dequantizes each of them in numpy.
SUPPORTED_TENSOR_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
                          _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same bytes, still mapped, but
    slicing skips np.memmap's per-view bookkeeping, which made reading Gemma's 262k-token
    vocabulary take 30 s instead of 5."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


class GGUFFile:
    """The metadata and tensors of one GGUF file, with clear errors for what is missing."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist")
        try:
            self.reader = _PlainArrayReader(str(path))
        except Exception as e:  # gguf raises ValueError, struct.error, ... on damaged files
            raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self.reader.fields:
            raise ValueError(f"{self.path.name}: metadata key {key!r} is missing")
        return self.get(key)

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, in Hugging Face's [out, in] layout."""
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"{self.path.name}: tensor {name!r} is missing")
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_TENSOR_TYPES)
            raise ValueError(f"{self.path.name}: tensor {name!r} is {t.tensor_type.name}; "
                             f"supported: {supported}")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        return np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(shape), dtype=np.float32)

    def check_known(self, expected: set[str]) -> None:
        """Refuse tensors the importer would silently drop: they mean a variant it does not understand."""
        unknown = sorted(set(self.tensors) - expected)
        if unknown:
            raise ValueError(f"{self.path.name}: tensors this importer does not know: {', '.join(unknown[:5])}")


def check_shapes(gguf: GGUFFile, weights: dict[str, np.ndarray], want: dict[str, tuple[int, ...]]) -> None:
    """Every imported tensor has the shape its config implies, or the config and the file disagree."""
    for name, w in weights.items():
        if tuple(w.shape) != want[name]:
            raise ValueError(f"{gguf.path.name}: {name} has shape {tuple(w.shape)}, "
                             f"the config implies {want[name]}")


def special_token_ids(gguf: GGUFFile) -> dict[str, int]:
    """The bos/eos/pad ids the GGUF names, under config.json's keys."""
    out = {}
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = gguf.get(f"tokenizer.ggml.{key}")
        if value is not None:
            out[name] = int(value)
    return out
