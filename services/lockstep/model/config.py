"""The model's shape, read from a Hugging Face `config.json`, in the one vocabulary the engine uses.

Llama, Qwen2 and Mistral checkpoints differ only in a few switches (q/k/v bias, tied embeddings,
sliding-window layers, RoPE scaling); reading them here keeps the model code free of per-family cases.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The checkpoint is of a kind this model code does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `default` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name_or_path: str = ""  # `_name_or_path`: where the checkpoint came from, the served name's default

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise UnsupportedModelError(
                f"layer types {bad} are not supported; supported: {list(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UnsupportedModelError(
                "layer_types names sliding_attention layers but sliding_window is not set")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding_window must be positive, got {self.sliding_window}")

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` in tokens (the query's own position included), None for full."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        arch = _architecture(d)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported; only 'silu' is")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError(f"pretraining_tp={d['pretraining_tp']} is not supported; only 1 is")
        hidden = _int(d, "hidden_size")
        heads = _int(d, "num_attention_heads")
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = d.get("head_dim") or hidden // heads
        layers = _int(d, "num_hidden_layers")
        theta, scaling = _rope(d, arch)

        window: int | None = d.get("sliding_window")
        if arch == "Qwen2ForCausalLM":
            window = window if d.get("use_sliding_window", False) else None
            layer_types = d.get("layer_types") or [
                "sliding_attention" if window is not None and i >= d.get("max_window_layers", 28)
                else "full_attention"
                for i in range(layers)
            ]
        elif arch == "MistralForCausalLM":
            # transformers applies Mistral's window to every layer and ignores layer_types.
            layer_types = ["sliding_attention" if window else "full_attention"] * layers
        else:
            window = None
            layer_types = ["full_attention"] * layers
        if "sliding_attention" not in layer_types:
            window = None

        if arch == "Qwen2ForCausalLM":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif arch == "LlamaForCausalLM":
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = bool(d.get("mlp_bias", False))
        else:
            qkv_bias = o_bias = mlp_bias = False

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            intermediate_size=_int(d, "intermediate_size"),
            vocab_size=_int(d, "vocab_size"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=window,
            layer_types=tuple(layer_types),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name_or_path=str(d.get("_name_or_path") or ""),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json`, adding eos ids from `generation_config.json` (chat models put them there)."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json; a Hugging Face model directory is expected")
        config = cls.from_hf(json.loads(cfg_file.read_text()))
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id")
            extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
            if merged != config.eos_token_ids:
                config = replace(config, eos_token_ids=merged)
        return config


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        model_type = d.get("model_type")
        arch = _MODEL_TYPES.get(model_type, f"model_type={model_type!r}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _int(d: dict[str, Any], key: str) -> int:
    if key not in d:
        raise UnsupportedModelError(f"config.json has no {key!r}")
    return int(d[key])


def _rope(d: dict[str, Any], arch: str) -> tuple[float, RopeScaling]:
    """transformers 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch} with rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return theta, RopeScaling()
    factor = float(merged.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise UnsupportedModelError(f"rope scaling factor must be positive, got {factor}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in merged:
            raise UnsupportedModelError(f"llama3 rope scaling needs {key!r}")
    return theta, RopeScaling(
        "llama3",
        factor,
        float(merged["low_freq_factor"]),
        float(merged["high_freq_factor"]),
        int(merged["original_max_position_embeddings"]),
    )
