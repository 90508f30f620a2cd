"""The model's shape, read from a Hugging Face `config.json`, in the one vocabulary the engine uses.

Llama, Qwen2 and Mistral checkpoints differ only in a few switches (q/k/v bias, tied embeddings,
sliding-window layers, RoPE scaling); reading them here keeps the model code free of per-family cases.
Gemma 3 adds a few more (GeGLU, its attention scale, a RoPE base per attention kind, logit soft-capping),
read by `_gemma3` with transformers' defaults for the keys a config.json leaves out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lockstep.kv.paging import POOL_FULL, POOL_SLIDING

GEMMA3, GEMMA3_MULTIMODAL = "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", GEMMA3, GEMMA3_MULTIMODAL)
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                "gemma3_text": GEMMA3, "gemma3": GEMMA3_MULTIMODAL}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Gemma3TextConfig's defaults: transformers fills them in for keys a config.json leaves out (a multimodal
# Gemma 3's text_config names only what differs from them, e.g. not even head_dim or the RoPE bases).
GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}
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

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            return
        if not 0 < self.low_freq_factor < self.high_freq_factor or not math.isfinite(self.high_freq_factor):
            raise UnsupportedModelError("llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                                        f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.original_max_position_embeddings < 1:
            raise UnsupportedModelError("llama3 rope scaling's original_max_position_embeddings must be positive, "
                                        f"got {self.original_max_position_embeddings}")


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
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma); None: head_dim's
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set (Gemma)
    sliding_rope_theta: float | None = None  # RoPE of sliding layers when it differs from full layers' (Gemma 3)
    sliding_rope_scaling: RopeScaling | None = None
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
        if self.max_position_embeddings < 2:  # a prompt token and the one it generates
            raise UnsupportedModelError(
                f"max_position_embeddings must be at least 2, got {self.max_position_embeddings}")
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
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"{self.architecture} with activation {self.hidden_act!r} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}")
        self._check_numbers()

    def _check_numbers(self) -> None:
        """The float fields a checkpoint's config sets: each out of its range makes the model's output NaN."""
        for name in ("rope_theta", "sliding_rope_theta"):  # 0 or NaN makes every logit NaN, served as token 0
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UnsupportedModelError(f"{name} must be positive and finite, got {value}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise UnsupportedModelError(f"rms_norm_eps must be at least 0 and finite, got {self.rms_norm_eps}")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UnsupportedModelError(f"{name} must be positive, got {value}")

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax: Gemma's query_pre_attn_scalar ** -0.5, else head_dim's."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_of(self, layer: int) -> tuple[float, RopeScaling]:
        """(theta, scaling) of `layer`'s RoPE: Gemma 3 rotates sliding layers with a base of their own."""
        if self.layer_types[layer] == "sliding_attention" and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling or RopeScaling()
        return self.rope_theta, self.rope_scaling

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` in tokens (the query's own position included), None for full."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def pool_of(self, layer: int) -> str:
        """The KV pool whose pages hold `layer`'s keys: named after its attention kind (DESIGN.md)."""
        return POOL_SLIDING if self.window(layer) is not None else POOL_FULL

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools this model's layers need, `full` first (a model whose every layer slides, such as
        Mistral with a window, has only `sliding`: its pool holds only windows)."""
        kinds = {self.pool_of(i) for i in range(self.num_layers)}
        return tuple(p for p in (POOL_FULL, POOL_SLIDING) if p in kinds)

    def layers_of(self, pool: str) -> int:
        """How many layers keep their KV in `pool`."""
        return sum(1 for i in range(self.num_layers) if self.pool_of(i) == pool)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        arch = _architecture(d)
        quantized = d.get("quantization_config")
        if quantized:  # its weights are codes and scales: read as floats they give garbage, not an error
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
            raise UnsupportedModelError(f"quantized checkpoints (quantization_config.quant_method={method!r}) are not "
                                        "supported; serve the unquantized (float16, bfloat16 or float32) checkpoint")
        if arch in (GEMMA3, GEMMA3_MULTIMODAL):
            return _gemma3(d, arch)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported; only 'silu' is")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError(f"pretraining_tp={d['pretraining_tp']} is not supported; only 1 is")
        hidden = _int(d, "hidden_size")
        heads = _int(d, "num_attention_heads")
        if heads < 1:
            raise UnsupportedModelError(f"num_heads must be positive, got {heads}")
        kv_heads = heads if d.get("num_key_value_heads") is None else _int(d, "num_key_value_heads")
        head_dim = hidden // heads if d.get("head_dim") is None else _int(d, "head_dim")
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

        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_int(d, "intermediate_size"),
            vocab_size=_int(d, "vocab_size"),
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=window,
            layer_types=tuple(layer_types),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            **_ids(d),
        )

    @staticmethod
    def checkpoint_dtype(path: str | Path) -> str | None:
        """The dtype the checkpoint says its weights are in (`dtype`, or the older `torch_dtype`; a
        multimodal one's text model's), None when it says none."""
        d = json.loads((Path(path) / "config.json").read_text())
        for where in (d, d.get("text_config") or {}):
            found = where.get("dtype") or where.get("torch_dtype")
            if isinstance(found, str):
                return found.removeprefix("torch.")
        return None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json`, adding eos ids from `generation_config.json` (chat models put them there)."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json; a Hugging Face model directory is expected")
        config = cls.from_hf(_json_file(cfg_file))
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            extra = token_ids(_json_file(gen_file).get("eos_token_id"), "generation_config.json's 'eos_token_id'")
            merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
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


def _gemma3(d: dict[str, Any], arch: str) -> ModelConfig:
    """Gemma 3's text decoder, from a `gemma3_text` config or the `text_config` of a multimodal `gemma3` one."""
    if arch == GEMMA3_MULTIMODAL:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedModelError(f"{arch} config.json has no text_config")
        top = {k: d[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "_name_or_path") if k in d}
        d = {**top, **text}
    d = {**GEMMA3_DEFAULTS, **d}
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
    if d.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(
            f"attn_logit_softcapping={d['attn_logit_softcapping']} is not supported: paged attention has no "
            "soft-capping of scores (Gemma 3 checkpoints have none)")
    layers = _int(d, "num_hidden_layers")
    layer_types = d.get("layer_types")
    if not layer_types:
        pattern = int(d.get("sliding_window_pattern") or 6)  # as transformers 5: `_sliding_window_pattern` is not read
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    window = d.get("sliding_window") if "sliding_attention" in layer_types else None
    full_theta, full_scaling, sliding_theta, sliding_scaling = _gemma3_rope(d, arch)
    heads = _int(d, "num_attention_heads")
    bias = bool(d.get("attention_bias", False))
    softcap = d.get("final_logit_softcapping")
    return ModelConfig(
        architecture=GEMMA3,
        hidden_size=_int(d, "hidden_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=_int(d, "head_dim"),
        intermediate_size=_int(d, "intermediate_size"),
        vocab_size=_int(d, "vocab_size"),
        rms_norm_eps=_float(d, "rms_norm_eps"),
        rope_theta=full_theta,
        rope_scaling=full_scaling,
        qkv_bias=bias,
        o_bias=bias,
        tie_word_embeddings=bool(d["tie_word_embeddings"]),
        hidden_act=str(d["hidden_activation"]),
        query_pre_attn_scalar=_float(d, "query_pre_attn_scalar"),
        final_logit_softcapping=None if softcap is None else _float(d, "final_logit_softcapping"),
        sliding_rope_theta=sliding_theta,
        sliding_rope_scaling=sliding_scaling,
        sliding_window=window,
        layer_types=tuple(layer_types),
        max_position_embeddings=int(d["max_position_embeddings"]),
        **_ids(d),
    )


def _gemma3_rope(d: dict[str, Any], arch: str) -> tuple[float, RopeScaling, float, RopeScaling]:
    """(theta, scaling) of full, then of sliding layers, as transformers 5 reads them: `rope_parameters` keyed
    by layer kind, or the older `rope_theta` (+ `rope_scaling`, full layers only) and `rope_local_base_freq`."""
    params = d.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES):
        raise UnsupportedModelError(
            f"{arch} rope_parameters must be keyed by layer kind ({', '.join(LAYER_TYPES)}), got {params!r}")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.update(d.get("rope_scaling") or {})
    full.setdefault("rope_theta", d.get("rope_theta") or GEMMA3_DEFAULTS["rope_theta"])
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", d.get("rope_local_base_freq") or GEMMA3_DEFAULTS["rope_local_base_freq"])
    return (_float(full, "rope_theta"), _scaling(full, arch),
            _float(sliding, "rope_theta"), _scaling(sliding, arch))


def _ids(d: dict[str, Any]) -> dict[str, Any]:
    """bos, eos ids and the checkpoint's name: the ModelConfig fields every family reads the same way."""
    bos = d.get("bos_token_id")
    if bos is not None:
        bos = json_integer(bos)
        if bos is None or bos < 0:
            raise UnsupportedModelError(f"config.json's 'bos_token_id' must be a token id, not {d['bos_token_id']!r}")
    return {"bos_token_id": bos, "eos_token_ids": token_ids(d.get("eos_token_id"), "config.json's 'eos_token_id'"),
            "name_or_path": str(d.get("_name_or_path") or "")}


def token_ids(value: Any, where: str) -> tuple[int, ...]:
    """An `eos_token_id` as a tuple: one id, a list of them, or none; a token's text there is named, not cast."""
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    out = [json_integer(i) for i in ids]
    if any(i is None or i < 0 for i in out):
        raise UnsupportedModelError(f"{where} must be a token id or a list of them, not {value!r}")
    return tuple(out)  # type: ignore[arg-type]  # None refused above


def json_integer(value: Any) -> int | None:
    """A JSON integer (30 or 30.0, as JSON Schema reads it) as an int; None for anything else (a string, true,
    2.5): config files and API request bodies are read by the same rule."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value)


def _int(d: dict[str, Any], key: str) -> int:
    if key not in d:
        raise UnsupportedModelError(f"config.json has no {key!r}")
    value = json_integer(d[key])
    if value is None:
        raise UnsupportedModelError(f"config.json's {key!r} must be an integer, not {d[key]!r}")
    return value


def _float(d: dict[str, Any], key: str, default: float | None = None) -> float:
    """A number of config.json (its `default` when absent; required when there is none), named when it is not."""
    if key not in d and default is not None:
        return default
    if key not in d:
        raise UnsupportedModelError(f"config.json has no {key!r}")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModelError(f"config.json's {key!r} must be a number, not {value!r}")
    return float(value)


def _rope(d: dict[str, Any], arch: str) -> tuple[float, RopeScaling]:
    """transformers 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    theta = _float(params, "rope_theta", None) if "rope_theta" in params else _float(d, "rope_theta", 10000.0)
    return theta, _scaling({**legacy, **params}, arch)


def _scaling(merged: dict[str, Any], arch: str) -> RopeScaling:
    """The scaling of one RoPE parameter dict (transformers' `rope_parameters` or a legacy `rope_scaling`)."""
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch} with rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return RopeScaling()
    factor = _float(merged, "factor", 1.0)
    if not math.isfinite(factor) or factor <= 0:
        raise UnsupportedModelError(f"rope scaling factor must be positive, got {factor}")
    if rope_type == "linear":
        return RopeScaling("linear", factor)
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in merged:
            raise UnsupportedModelError(f"llama3 rope scaling needs {key!r}")
    return RopeScaling(
        "llama3",
        factor,
        _float(merged, "low_freq_factor"),
        _float(merged, "high_freq_factor"),
        _int(merged, "original_max_position_embeddings"),
    )


def _json_file(path: Path) -> dict[str, Any]:
    """A config file's JSON object, or UnsupportedModelError naming the file."""
    try:
        found = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(found, dict):
        raise UnsupportedModelError(f"{path} holds a JSON {type(found).__name__}, not an object")
    return found
