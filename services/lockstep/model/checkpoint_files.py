"""A checkpoint's safetensors files: which file holds which tensor, each opened with its errors named.

Apart from the loader (and torch) so that `lockstep serve` can check every file's header before it starts a
rank: a truncated or foreign file would otherwise fail each rank as it loads, restart after restart.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match what its config.json says the model is."""


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json when present, else from every file's header."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (ValueError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a JSON object: {e}") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors file")
    where: dict[str, Path] = {}
    for file in files:
        with opened(file) as f:
            for name in f.keys():
                if name in where:
                    raise CheckpointError(f"tensor {name!r} is in both {where[name].name} and {file.name}: which "
                                          "one is the model's is not known (an index, model.safetensors.index.json, "
                                          "would say)")
                where[name] = file
    return where


@contextmanager
def opened(file: Path, framework: str = "numpy") -> Iterator[Any]:
    """A safetensors file, open; one that cannot be read (truncated, not safetensors) is a CheckpointError
    naming it, here and for the tensors read from it."""
    try:
        with safe_open(file, framework=framework, device="cpu") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{file} cannot be read as safetensors: {e}") from e


def check_checkpoint(path: Path) -> None:
    """CheckpointError unless every safetensors file the checkpoint names is there and its header reads."""
    for file in sorted(set(tensor_files(path).values())):
        if not file.is_file():
            raise CheckpointError(f"{path}'s index names {file.name}, which is not there")
        with opened(file):
            pass
