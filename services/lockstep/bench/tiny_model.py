"""The tiny random Llama that `lockstep bench --tiny` serves: fast enough for a 2-core machine."""

from __future__ import annotations

import json
from pathlib import Path


def build_tiny_model(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2, max_positions: int = 512) -> Path:
    """A random Llama (4 heads / 2 KV heads, vocab 384; hidden 64 and 2 layers unless asked) with a word-level
    tokenizer (ids w3..w383).

    Weights are drawn wider than transformers' default init so greedy decoding has no near-ties and the
    served and in-process runs can be compared token for token.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    vocab = 384
    path.mkdir(parents=True, exist_ok=True)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "model_max_length": max_positions}))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if "embed_tokens" in name else 0.15
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                    else scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return path
