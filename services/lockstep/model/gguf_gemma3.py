"""Gemma 3 (text) from a llama.cpp GGUF: the Hugging Face `gemma3_text` config and tensors.

What llama.cpp's converter changed, and this module undoes or restores:
- every RMSNorm weight (input, post-attention, pre/post-feedforward, q_norm, k_norm, final) is
  stored as 1 + w, because Hugging Face's Gemma computes x * (1 + w); the import subtracts the 1.
  (Evidence in the real file: w = stored - 1 is exactly bfloat16, the checkpoint's dtype, while the
  stored values are not.)
- q and k are NOT permuted for Gemma (only Llama-family converters do that), so rows stay as they are.
- the file does not say which layers slide, the local RoPE base or the attention scale: llama.cpp
  hard-codes them for Gemma 3 (every 6th layer global, base 10000, 1/sqrt(head_dim) except 27B's
  1/sqrt(hidden/heads)); newer files may carry the pattern and the base, which win when present.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lockstep.model.gguf_file import GGUFFile, check_shapes, special_token_ids

ARCH = "gemma3"
_DEFAULT_PATTERN = 6
_DEFAULT_LOCAL_BASE = 10_000.0
_27B_LAYERS = 62  # llama.cpp's test for the one size whose attention scale is hidden/heads

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _layer_types(gguf: GGUFFile, layers: int) -> tuple[list[str], int | None]:
    """Which layers slide: the file's `sliding_window_pattern` (an int, or one flag per layer), else 6."""
    pattern = gguf.get(f"{ARCH}.attention.sliding_window_pattern", _DEFAULT_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{gguf.path.name}: sliding_window_pattern has {len(pattern)} flags for {layers} layers")
        return ["sliding_attention" if flag else "full_attention" for flag in pattern], None
    every = int(pattern)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)], every


def _rope(gguf: GGUFFile) -> dict[str, Any]:
    """RoPE of global layers (the file's base and scaling) and of sliding ones (local base, unscaled)."""
    theta = float(gguf.get(f"{ARCH}.rope.freq_base", 1_000_000.0))
    local = float(gguf.get(f"{ARCH}.rope.freq_base_swa", _DEFAULT_LOCAL_BASE))
    kind = gguf.get(f"{ARCH}.rope.scaling.type", "none")
    scaling: dict[str, Any] | None = None
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(gguf.require(f"{ARCH}.rope.scaling.factor"))}
    elif kind not in ("none", None):
        raise ValueError(f"{gguf.path.name}: RoPE scaling {kind!r} is not supported for Gemma 3")
    full = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    return {"rope_theta": theta, "rope_local_base_freq": local, "rope_scaling": scaling,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}}}


def gemma3_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json for transformers' Gemma3ForCausalLM, from the file's `gemma3.*` metadata."""
    hidden = int(gguf.require(f"{ARCH}.embedding_length"))
    heads = int(gguf.require(f"{ARCH}.attention.head_count"))
    layers = int(gguf.require(f"{ARCH}.block_count"))
    head_dim = int(gguf.get(f"{ARCH}.attention.key_length", hidden // heads))
    if int(gguf.get(f"{ARCH}.attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{gguf.path.name}: key and value head sizes differ, which Gemma 3 never has")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{gguf.path.name}: tensor 'token_embd.weight' is missing")
    layer_types, pattern = _layer_types(gguf, layers)
    softcap = gguf.get(f"{ARCH}.final_logit_softcapping")
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(gguf.require(f"{ARCH}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.get(f"{ARCH}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": int(embed.shape[1]),
        "max_position_embeddings": int(gguf.get(f"{ARCH}.context_length", 32768)),
        # stored as float32: 1e-6 reads back as 9.99999997e-07; 7 digits give the written value back
        "rms_norm_eps": float(f"{gguf.get(f'{ARCH}.attention.layer_norm_rms_epsilon', 1e-6):.7g}"),
        "sliding_window": int(gguf.require(f"{ARCH}.attention.sliding_window")),
        "layer_types": layer_types,
        **({"sliding_window_pattern": pattern} if pattern else {}),
        **_rope(gguf),
        "query_pre_attn_scalar": hidden // heads if layers == _27B_LAYERS else head_dim,
        "final_logit_softcapping": None if softcap is None else float(softcap),
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "torch_dtype": "float32",
    }
    return {**config, **special_token_ids(gguf)}


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, d, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
             "self_attn.o_proj": (h, q), "self_attn.q_norm": (d,), "self_attn.k_norm": (d,),
             "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    layer.update({n: (h,) for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                    "post_feedforward_layernorm")})
    want = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,),
            "lm_head.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        want.update({f"model.layers.{i}.{n}.weight": s for n, s in layer.items()})
    return want


def gemma3_weights(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 tensors; norms shifted back from llama.cpp's 1 + w to w."""
    layers = config["num_hidden_layers"]
    gguf.check_known({f"{g}.weight" for g in _GLOBAL_TENSORS}
                     | {f"blk.{i}.{n}.weight" for i in range(layers) for n in _LAYER_TENSORS})
    names = {f"{g}.weight": f"{hf}.weight" for g, hf in _GLOBAL_TENSORS.items()
             if not (g == "output" and config["tie_word_embeddings"])}
    names.update({f"blk.{i}.{g}.weight": f"model.layers.{i}.{hf}.weight"
                  for i in range(layers) for g, hf in _LAYER_TENSORS.items()})
    out: dict[str, np.ndarray] = {}
    for source, target in names.items():
        w = gguf.tensor(source)
        out[target] = w - np.float32(1.0) if source.endswith("norm.weight") else w
    check_shapes(gguf, out, _shapes(config))
    return out
