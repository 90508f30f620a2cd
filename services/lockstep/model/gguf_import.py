"""Turn a llama.cpp GGUF file into a Hugging Face checkpoint directory, once.

The loader, the coordinator and transformers all read Hugging Face directories, so a GGUF is
converted instead of taught to each of them: config.json, model.safetensors (dequantized to
float32), tokenizer.json and tokenizer_config.json. The conversion reads the file with the `gguf`
package only and imports no torch, so the coordinator can run it too.

llama.cpp's converter permutes the rows of q_proj and k_proj so that its RoPE rotates adjacent
pairs (x0, x1) instead of Hugging Face's halves (x0, x_{d/2}); the import reverses that exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0,
                          GGMLQuantizationType.Q4_1)

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

# llama.cpp token types (llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# `tokenizer.ggml.pre` names how llama.cpp splits text before BPE; each maps to the Hugging Face
# pre-tokenizer of the models that carry it (SmolLM and StarCoder split every digit on its own).
PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "gpt2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
    "refact": _digits_then_byte_level,
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


class GGUFFile:
    """The metadata and tensors of one GGUF file, with clear errors for what is missing."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist")
        try:
            self.reader = GGUFReader(str(path))
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


def _model_config(gguf: GGUFFile) -> dict[str, Any]:
    arch = gguf.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf.path.name}: architecture {arch!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)})")
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
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = gguf.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = int(value)
    return config


def _weights(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, np.ndarray]:
    expected = {f"{g}.weight" for g in _GLOBAL_TENSORS} | {
        f"blk.{i}.{n}.weight" for i in range(config["num_hidden_layers"]) for n in _LAYER_TENSORS}
    unknown = sorted(set(gguf.tensors) - expected)
    if unknown:
        raise ValueError(f"{gguf.path.name}: tensors this importer does not know: {', '.join(unknown[:5])}")
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
    _check_shapes(gguf, config, out)
    return out


def _check_shapes(gguf: GGUFFile, config: dict[str, Any], weights: dict[str, np.ndarray]) -> None:
    h, d, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "self_attn.q_proj": (q, h),
             "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
             "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    want = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,),
            "lm_head.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        want.update({f"model.layers.{i}.{n}.weight": s for n, s in layer.items()})
    for name, w in weights.items():
        if tuple(w.shape) != want[name]:
            raise ValueError(f"{gguf.path.name}: {name} has shape {tuple(w.shape)}, "
                             f"the config implies {want[name]}")


def build_tokenizer(gguf: GGUFFile) -> tuple[BackendTokenizer, dict[str, Any]]:
    """A byte-level BPE tokenizer from the file's tokens, merges and token types, and its config."""
    model = gguf.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{gguf.path.name}: tokenizer model {model!r} is not supported "
                         "(only byte-level BPE, 'gpt2')")
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{gguf.path.name}: pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = list(gguf.require("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    types = list(gguf.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{gguf.path.name}: the token list has duplicates, which a BPE vocabulary "
                         "cannot hold")
    if len(types) != len(tokens):
        raise ValueError(f"{gguf.path.name}: {len(types)} token types for {len(tokens)} tokens")

    tok = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED])

    def token(key: str) -> str | None:
        index = gguf.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"{gguf.path.name}: tokenizer.ggml.{key} = {index} is outside the vocabulary")
        return tokens[int(index)]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    ends = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                       special_tokens=list(dict.fromkeys(ends)))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.get("llama.context_length", 2048)),
    }
    template = gguf.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tok, config


def import_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write `out_dir` as a Hugging Face Llama checkpoint converted from `gguf_path`, atomically.

    Everything is written to a temporary sibling directory that is renamed into place at the end,
    so an interrupted import leaves no directory that looks complete.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    gguf = GGUFFile(gguf_path)
    config = _model_config(gguf)
    tokenizer, tokenizer_config = build_tokenizer(gguf)
    weights = _weights(gguf, config)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise ValueError(f"{gguf_path.name}: the tokenizer has more ids than the embedding has rows")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
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
