"""Load this rank's shard of a Hugging Face checkpoint, reading only the slices it holds.

A 70B checkpoint is far larger than one rank's memory; `safe_open(...).get_slice` reads just the rows
or columns a rank keeps, so loading costs each rank its own shard and no more. Tensors are named as
transformers names them; the model class is chosen by the config's architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from lockstep.model.checkpoint_files import CheckpointError, opened, tensor_files
from lockstep.model.config import GEMMA3, ModelConfig
from lockstep.model.gemma3 import Gemma3Model
from lockstep.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from lockstep.model.llama import LlamaModel
from lockstep.parallel.comm import Comm


@dataclass(frozen=True)
class Read:
    """Copy checkpoint tensor `name` (full shape `shape`), rows or columns [start, start+length) along
    `dim` (None: the whole tensor), into `param` at `offset` along the same dim."""

    name: str
    shape: tuple[int, ...]
    param: torch.Tensor
    dim: int | None = None
    start: int = 0
    length: int = 0
    offset: int = 0


def _column(prefix: str, names: list[str], layer: ColumnParallelLinear) -> Iterator[Read]:
    for name, part in zip(names, layer.parts, strict=True):
        yield Read(f"{prefix}.{name}.weight", (part.total, layer.in_features), layer.weight,
                   0, part.start, part.length, part.offset)
        if layer.bias is not None:
            yield Read(f"{prefix}.{name}.bias", (part.total,), layer.bias,
                       0, part.start, part.length, part.offset)


def _row(name: str, layer: RowParallelLinear) -> Iterator[Read]:
    yield Read(f"{name}.weight", (layer.out_features, layer.in_total), layer.weight,
               1, layer.in_start, layer.in_local, 0)
    if layer.bias is not None:
        yield Read(f"{name}.bias", (layer.out_features,), layer.bias)


def plan_reads(model: LlamaModel) -> list[Read]:
    """Every checkpoint tensor this shard needs and where each slice goes."""
    cfg = model.config
    emb = model.embed_tokens
    vocab_rows = ((cfg.vocab_size, cfg.hidden_size), emb.weight, 0, emb.vocab_start, emb.vocab_local, 0)
    reads = [Read("model.embed_tokens.weight", *vocab_rows)]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        # Every norm of a layer (Gemma 3 has six, q/k norms included) sits where transformers names it.
        for name, norm in layer.named_modules():
            if isinstance(norm, RMSNorm):
                reads.append(Read(f"{p}.{name}.weight", tuple(norm.weight.shape), norm.weight))
        reads += _column(f"{p}.self_attn", ["q_proj", "k_proj", "v_proj"], layer.self_attn.qkv_proj)
        reads += _row(f"{p}.self_attn.o_proj", layer.self_attn.o_proj)
        reads += _column(f"{p}.mlp", ["gate_proj", "up_proj"], layer.mlp.gate_up_proj)
        reads += _row(f"{p}.mlp.down_proj", layer.mlp.down_proj)
    reads.append(Read("model.norm.weight", (cfg.hidden_size,), model.norm.weight))
    if not model.lm_head.tied:
        head = model.lm_head
        reads.append(Read("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), head.weight,
                          0, head.vocab_start, head.vocab_local, 0))
    return reads


MODEL_CLASSES: dict[str, type[LlamaModel]] = {GEMMA3: Gemma3Model}

# Where a checkpoint keeps the text decoder and its LM head: a multimodal Gemma 3 nests them under its
# language model (transformers 5, then 4.x names).
_TEXT_PREFIXES = (("model.", "lm_head."), ("model.language_model.", "lm_head."),
                  ("language_model.model.", "language_model.lm_head."))


# Tensors a checkpoint may hold that are not weights of the model: rotary buffers of older Llama checkpoints, and
# (with tied embeddings) a copy of the embeddings saved as the LM head. transformers and vLLM skip them too.
_NOT_WEIGHTS = (".rotary_emb.inv_freq",)


def _checkpoint_names(where: dict[str, Path]) -> tuple[Callable[[str], str], Callable[[str], bool]]:
    """Maps the names plan_reads uses (`model.*`, `lm_head.*`) to the names this checkpoint uses; and which of
    the checkpoint's names are the text decoder's (a multimodal checkpoint's vision tower is not)."""
    body, head = next(((b, h) for b, h in _TEXT_PREFIXES if f"{b}embed_tokens.weight" in where), _TEXT_PREFIXES[0])

    def rename(name: str) -> str:
        if name.startswith("model."):
            return body + name.removeprefix("model.")
        return head + name.removeprefix("lm_head.")

    def decoder(name: str) -> bool:
        return name.startswith((body, head)) and not name.endswith(_NOT_WEIGHTS)

    return rename, decoder


def _check_all_read(path: Path, where: dict[str, Path], read: set[str], decoder: Callable[[str], bool],
                    tied_head: str | None) -> None:
    """A decoder tensor the model does not read means config.json describes another model than the weights (a
    bias, a layer or an expert it would drop): served, it would answer garbage, so it is refused by name."""
    unread = sorted(n for n in where if decoder(n) and n not in read and n != tied_head)
    if unread:
        shown = ", ".join(repr(n) for n in unread[:5]) + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
        raise CheckpointError(f"checkpoint {path} has {len(unread)} tensor{'s' if len(unread) > 1 else ''} the model "
                              f"its config.json describes does not use: {shown}; config.json does not describe "
                              "these weights (a bias, layer count or architecture differs)")


def _checked_slice(handle: Any, file: Path, r: Read, config: ModelConfig) -> Any:
    """The tensor `r` reads, as a lazy slice, once its dtype and full shape are the ones the model needs."""
    try:
        sl = handle.get_slice(r.name)
    except SafetensorError as e:
        raise CheckpointError(f"{file} has no readable tensor {r.name!r}: {e}") from e
    if not sl.get_dtype().startswith(("F", "BF")) or sl.get_dtype().startswith("F8"):
        raise CheckpointError(f"tensor {r.name!r} in {file.name} is {sl.get_dtype()}: only float16, bfloat16 "
                              "and float32 weights are read (a quantized checkpoint is not supported)")
    shape = tuple(sl.get_shape())
    if shape != r.shape:
        raise CheckpointError(f"tensor {r.name!r} in {file.name} has shape {list(shape)}, "
                              f"but {config.architecture} with this config.json needs {list(r.shape)}")
    return sl


def load_model(
    path: str | Path, comm: Comm, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> LlamaModel:
    """Build this rank's shard of the model in `path` on `device` and fill it from the checkpoint."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    with torch.device(device):
        model = MODEL_CLASSES.get(config.architecture, LlamaModel)(config, comm)
    model.to(dtype=dtype)
    where = tensor_files(path)
    rename, decoder = _checkpoint_names(where)
    reads = [replace(r, name=rename(r.name)) for r in plan_reads(model)]
    _check_all_read(path, where, {r.name for r in reads}, decoder,
                    rename("lm_head.weight") if model.lm_head.tied else None)
    with ExitStack() as stack:
        files: dict[Path, object] = {}
        for r in reads:
            file = where.get(r.name)
            if file is None:
                raise CheckpointError(
                    f"checkpoint {path} has no tensor {r.name!r} (expected shape {list(r.shape)})")
            if file not in files:
                if not file.is_file():
                    raise CheckpointError(f"{r.name!r} is mapped to {file.name}, which is not in {path}")
                files[file] = stack.enter_context(opened(file, "pt"))
            sl = _checked_slice(files[file], file, r, config)
            if r.dim is None:
                part, dst = sl[:], r.param.data
            elif r.dim == 0:
                part = sl[r.start: r.start + r.length]
                dst = r.param.data.narrow(0, r.offset, r.length)
            else:
                part = sl[:, r.start: r.start + r.length]
                dst = r.param.data.narrow(1, r.offset, r.length)
            dst.copy_(part)
    return model.eval()
