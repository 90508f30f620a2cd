"""Turn a llama.cpp GGUF file into a Hugging Face checkpoint directory, once.

The loader, the coordinator and transformers all read Hugging Face directories, so a GGUF is
converted instead of taught to each of them: config.json, model.safetensors (dequantized to
float32), tokenizer.json and tokenizer_config.json. The conversion reads the file with the `gguf`
package only and imports no torch, so the coordinator can run it too.

Two architectures: Llama here, Gemma 3 in gguf_gemma3; the tokenizer is rebuilt in gguf_tokenizer.
llama.cpp's converter permutes the rows of Llama's q_proj and k_proj so that its RoPE rotates
adjacent pairs (x0, x1) instead of Hugging Face's halves (x0, x_{d/2}); the import reverses that.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from lockstep.model.gguf_file import GGUFFile, check_shapes, special_token_ids
from lockstep.model.gguf_gemma3 import gemma3_config, gemma3_weights
from lockstep.model.gguf_tokenizer import build_tokenizer, end_of_turn_ids

__all__ = ["GGUFFile", "SUPPORTED_ARCHITECTURES", "build_tokenizer", "import_gguf", "unpermute_rope_rows"]

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

# llama.cpp's per-layer tensor names and the Hugging Face names they came from.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute(): per head, rows were reordered from halves to interleaved pairs.

    llama.cpp wrote w.reshape(h, 2, d/2, in).swapaxes(1, 2); reading the result as (h, d/2, 2, in)
    and swapping back restores Hugging Face's order.
    """
    rows = weight.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot unpermute {rows} rows into {n_heads} heads of even size")
    head_dim = rows // n_heads
    return np.ascontiguousarray(
        weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape))


def _llama_config(gguf: GGUFFile) -> dict[str, Any]:
    arch = "llama"
    scaling = gguf.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{gguf.path.name}: RoPE scaling {scaling!r} is not supported")
    if f"{arch}.expert_count" in gguf.reader.fields and gguf.get(f"{arch}.expert_count"):
        raise ValueError(f"{gguf.path.name}: mixture-of-experts llama files are not supported")
    hidden = int(gguf.require(f"{arch}.embedding_length"))
    heads = int(gguf.require(f"{arch}.attention.head_count"))
    kv_heads = int(gguf.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(gguf.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(gguf.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{gguf.path.name}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{gguf.path.name}: tensor 'token_embd.weight' is missing")
    vocab = int(embed.shape[1])
    tokens = gguf.get("tokenizer.ggml.tokens")
    declared = gguf.get(f"{arch}.vocab_size", vocab if tokens is None else len(tokens))
    if int(declared) != vocab:
        raise ValueError(f"{gguf.path.name}: vocab_size {declared} but token_embd has {vocab} rows")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(gguf.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(gguf.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(gguf.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "torch_dtype": "float32",
    }
    return {**config, **special_token_ids(gguf)}


def _llama_weights(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, np.ndarray]:
    gguf.check_known({f"{g}.weight" for g in _GLOBAL_TENSORS} | {
        f"blk.{i}.{n}.weight" for i in range(config["num_hidden_layers"]) for n in _LAYER_TENSORS})
    out: dict[str, np.ndarray] = {}
    for name, hf in _GLOBAL_TENSORS.items():
        if name == "output" and config["tie_word_embeddings"]:
            continue
        out[f"{hf}.weight"] = gguf.tensor(f"{name}.weight")
    for i in range(config["num_hidden_layers"]):
        for name, hf in _LAYER_TENSORS.items():
            w = gguf.tensor(f"blk.{i}.{name}.weight")
            if name == "attn_q":
                w = unpermute_rope_rows(w, config["num_attention_heads"])
            elif name == "attn_k":
                w = unpermute_rope_rows(w, config["num_key_value_heads"])
            out[f"model.layers.{i}.{hf}.weight"] = w
    check_shapes(gguf, out, _llama_shapes(config))
    return out


def _llama_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, d, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "self_attn.q_proj": (q, h),
             "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
             "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    want = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,),
            "lm_head.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        want.update({f"model.layers.{i}.{n}.weight": s for n, s in layer.items()})
    return want


_Importer = tuple[Callable[[GGUFFile], dict[str, Any]], Callable[[GGUFFile, dict[str, Any]], dict[str, np.ndarray]]]
_IMPORTERS: dict[str, _Importer] = {"llama": (_llama_config, _llama_weights),
                                    "gemma3": (gemma3_config, gemma3_weights)}


def _importer(gguf: GGUFFile) -> _Importer:
    arch = gguf.require("general.architecture")
    if arch not in _IMPORTERS:
        raise ValueError(f"{gguf.path.name}: architecture {arch!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    return _IMPORTERS[arch]


def import_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write `out_dir` as a Hugging Face checkpoint (Llama or Gemma 3) converted from `gguf_path`, atomically.

    Everything is written to a temporary sibling directory that is renamed into place at the end,
    so an interrupted import leaves no directory that looks complete.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    gguf = GGUFFile(gguf_path)
    make_config, make_weights = _importer(gguf)
    config = make_config(gguf)
    tokenizer, tokenizer_config = build_tokenizer(gguf)
    weights = make_weights(gguf, config)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise ValueError(f"{gguf_path.name}: the tokenizer has more ids than the embedding has rows")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        stops = end_of_turn_ids(gguf)
        if "eos_token_id" in generation and stops:
            generation["eos_token_id"] = [generation["eos_token_id"], *stops]
        for name, data in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                           ("generation_config.json", generation)):
            (tmp / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
