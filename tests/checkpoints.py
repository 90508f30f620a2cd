"""Tiny random Hugging Face checkpoints, made at test time, with a real tokenizer that fits the vocab.

Kinds (all fp32, hidden 64 unless said, vocab 384):
- "llama_gqa": Llama, 4 heads / 2 KV heads, llama3 RoPE scaling, saved in several safetensors shards
  with an index (so sharded loading is exercised).
- "qwen2_bias_tied": Qwen2 (q/k/v bias) with tied embeddings.
- "sliding": Qwen2 with sliding_window 8 and layer_types mixing sliding and full attention, and a single
  KV head (replicated across ranks at TP 2).
- "llama_tp3": Llama, hidden 96, 6 heads / 3 KV heads, intermediate 96: a model that splits three ways, as the
  built-in does (TP 3 is what `lockstep serve` runs on a small machine).
Weights are drawn so that norms and biases are far from their defaults: a bug that ignores a bias or a
norm weight changes the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 384
HIDDEN = 64
BOS, EOS = "<s>", "</s>"
SPECIALS = [BOS, EOS, "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TEXT = """Lockstep serves a language model split across ranks by tensor parallelism.
Every rank holds its own shard of the weights and its own paged cache of keys and values.
The coordinator decides, once, what every rank admits, skips, evicts and computes at each step.
A page holds the keys and values of sixteen tokens; pages are chained by hashes of their tokens.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow.
0123456789 + - * / = ( ) [ ] { } < > ; : , . ? ! ' " @ # $ % ^ & _ ~ `
"""
KINDS = ("llama_gqa", "qwen2_bias_tied", "sliding", "llama_tp3")


def _tokenizer(path: Path) -> tuple[int, int]:
    """Train a byte-level BPE of exactly VOCAB tokens; write tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    filler = VOCAB - tok.get_vocab_size()
    if filler > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(filler)])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
    }, indent=2))
    return bos, eos


def _config(kind: str, bos: int, eos: int):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=HIDDEN, intermediate_size=128, vocab_size=VOCAB, num_attention_heads=4,
        max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=None,
    )
    if kind == "llama_gqa":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, rope_parameters=rope, **common)
    if kind == "llama_tp3":
        return LlamaConfig(**{**common, "hidden_size": 96, "num_attention_heads": 6, "intermediate_size": 96},
                           num_hidden_layers=2, num_key_value_heads=3)
    if kind == "qwen2_bias_tied":
        return Qwen2Config(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True, **common)
    if kind == "sliding":
        return Qwen2Config(
            num_hidden_layers=3, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common)
    raise ValueError(f"unknown checkpoint kind {kind!r}; kinds: {', '.join(KINDS)}")


def _randomize(model, gen, norm_center: float, norm_scale: float) -> None:
    """Weights drawn wider than transformers' init, so greedy decoding has no near-ties; norm weights around
    `norm_center` (1 where the norm multiplies by its weight, 0 where by 1 + weight, as Gemma's)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_center + norm_scale * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def make_checkpoint(kind: str, path: Path) -> Path:
    """Write checkpoint `kind` into directory `path` (made if needed) and return it; reuses a finished one."""
    import torch
    from transformers import AutoModelForCausalLM

    if kind in GEMMA3_KINDS:
        return make_gemma3_checkpoint(kind, path)
    path = Path(path)
    done = path / ".complete"
    if done.is_file() and done.read_text() == kind:
        return path
    path.mkdir(parents=True, exist_ok=True)
    bos, eos = _tokenizer(path)
    config = _config(kind, bos, eos)
    gen = torch.Generator().manual_seed(KINDS.index(kind) + 1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, gen, norm_center=1.0, norm_scale=0.2)
    shard = "40KB" if kind == "llama_gqa" else "50MB"
    model.save_pretrained(path, max_shard_size=shard)
    done.write_text(kind)
    return path


def random_prompt(seed: int, n: int, vocab: int = 256) -> list[int]:
    """n token ids drawn reproducibly from the ordinary (non-special) range of the tiny vocabularies."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# Tiny random Gemma 3 text checkpoints (fp32, hidden 64, vocab 384), made like the kinds above:
# - "gemma3_hybrid": transformers 5's config.json (rope_parameters keyed by layer kind, layer_types),
#   sliding window 8 on three layers of four, one KV head (replicated at TP 2), head_dim 32 != 64 / 4,
#   query_pre_attn_scalar 24, a RoPE base per kind with linear scaling on full layers, tied embeddings.
# - "gemma3_legacy": the older config.json (rope_theta, rope_local_base_freq, rope_scaling,
#   sliding_window_pattern 3, no layer_types), two KV heads, q/k/v/o biases, untied LM head and
#   final_logit_softcapping 5 (transformers reads this config through its backward-compatible path).
GEMMA3_KINDS = ("gemma3_hybrid", "gemma3_legacy")


def _gemma3_config(kind: str, bos: int, eos: int):
    from transformers import Gemma3TextConfig

    common = dict(hidden_size=HIDDEN, intermediate_size=128, vocab_size=VOCAB, num_attention_heads=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=bos, eos_token_id=eos,
                  pad_token_id=None, sliding_window=8)
    if kind == "gemma3_hybrid":
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
        kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        return Gemma3TextConfig(num_hidden_layers=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
                                rope_parameters=rope, layer_types=kinds, tie_word_embeddings=True, **common)
    if kind == "gemma3_legacy":
        return Gemma3TextConfig(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                attention_bias=True, tie_word_embeddings=False, final_logit_softcapping=5.0,
                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                    "rope_theta": 500.0},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"], **common)
    raise ValueError(f"unknown Gemma 3 checkpoint kind {kind!r}; kinds: {', '.join(GEMMA3_KINDS)}")


def _legacy_gemma3_json(path: Path) -> None:
    """Rewrite config.json in the pre-transformers-5 style that hub checkpoints still carry."""
    cfg_file = path / "config.json"
    d = json.loads(cfg_file.read_text())
    rope = d.pop("rope_parameters")
    d.pop("layer_types")
    d.pop("_sliding_window_pattern", None)
    full = rope["full_attention"]
    d.update(rope_theta=full["rope_theta"], rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
             rope_scaling={"rope_type": full["rope_type"], "factor": full["factor"]}, sliding_window_pattern=3)
    cfg_file.write_text(json.dumps(d, indent=2))


def make_gemma3_checkpoint(kind: str, path: Path) -> Path:
    """Write Gemma 3 checkpoint `kind` into `path` and return it. Norm weights are offsets from 1 in Gemma, so
    they are drawn around 0, far enough from it that a norm that drops its weight or its 1 is seen."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    done = path / ".complete"
    if done.is_file() and done.read_text() == kind:
        return path
    path.mkdir(parents=True, exist_ok=True)
    bos, eos = _tokenizer(path)
    gen = torch.Generator().manual_seed(100 + GEMMA3_KINDS.index(kind))
    model = AutoModelForCausalLM.from_config(_gemma3_config(kind, bos, eos), dtype=torch.float32)
    _randomize(model, gen, norm_center=0.0, norm_scale=0.3)
    model.save_pretrained(path)
    if kind == "gemma3_legacy":
        _legacy_gemma3_json(path)
    done.write_text(kind)
    return path
