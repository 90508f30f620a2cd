"""A Hugging Face `tokenizers` tokenizer rebuilt from a GGUF's vocabulary metadata.

Two llama.cpp tokenizer models are understood:
- "gpt2": byte-level BPE with the file's merges (SmolLM2, Llama 3, Qwen2);
- "llama": SentencePiece BPE (Gemma). The file has tokens, scores and token types but no merges.
  llama.cpp merges the adjacent pair whose joined text is the best-scored token, so the merges are
  rebuilt from the vocabulary ranked by that score; user-defined tokens (Gemma's runs of spaces,
  newlines and tabs, HTML tags) are matched whole in the raw text first, as llama.cpp does, and
  characters outside the vocabulary fall back to <0xXX> byte tokens.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from lockstep.model.gguf_file import GGUFFile

# llama.cpp token types (llama_token_type).
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6
_SPACE = "\u2581"  # SentencePiece's visible space

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Gemma's turn format, for Gemma files that carry no chat template (the base models' GGUFs): a
# system message opens the first user turn, the assistant's role is called "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.prefix = ns.prefix + m['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + ns.prefix"
    " + (m['content'] | trim) + '<end_of_turn>\n' }}{%- set ns.prefix = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
_GEMMA_END_OF_TURN = "<end_of_turn>"


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


class _Vocabulary:
    """tokens, their llama.cpp types and scores, checked against each other once."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.tokens = [str(t) for t in gguf.require("tokenizer.ggml.tokens")]
        self.types = [int(t) for t in gguf.get("tokenizer.ggml.token_type", [_NORMAL] * len(self.tokens))]
        self.scores = [float(s) for s in gguf.get("tokenizer.ggml.scores", [0.0] * len(self.tokens))]
        self.ids = {token: i for i, token in enumerate(self.tokens)}
        if len(self.ids) != len(self.tokens):
            raise ValueError(f"{gguf.path.name}: the token list has duplicates, which a BPE vocabulary cannot hold")
        for what, values in (("token types", self.types), ("scores", self.scores)):
            if len(values) != len(self.tokens):
                raise ValueError(f"{gguf.path.name}: {len(values)} {what} for {len(self.tokens)} tokens")

    def token(self, key: str) -> str | None:
        """The text of the token whose id `tokenizer.ggml.<key>` names, if any."""
        index = self.gguf.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(self.tokens):
            raise ValueError(f"{self.gguf.path.name}: tokenizer.ggml.{key} = {index} is outside the vocabulary")
        return self.tokens[int(index)]

    def of_type(self, kind: int) -> list[str]:
        return [t for t, k in zip(self.tokens, self.types, strict=True) if k == kind]


def _byte_level_bpe(vocab: _Vocabulary) -> BackendTokenizer:
    gguf = vocab.gguf
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{gguf.path.name}: pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))})")
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    tok = BackendTokenizer(models.BPE(vocab=vocab.ids, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_merges(vocab: _Vocabulary) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal token into two tokens, best-scored result first.

    Ranking by the joined token's score is llama.cpp's rule for which adjacent pair merges next;
    ties (several splits of one token) go by the parts' ids, which only orders equal outcomes.
    """
    ids, buildable = vocab.ids, set(vocab.of_type(_NORMAL))
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for token, kind, score in zip(vocab.tokens, vocab.types, vocab.scores, strict=True):
        if kind != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in buildable and right in buildable:
                ranked.append((-score, ids[token], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(vocab: _Vocabulary) -> BackendTokenizer:
    gguf = vocab.gguf
    unk = vocab.token("unknown_token_id")
    model = models.BPE(vocab=vocab.ids, merges=sentencepiece_merges(vocab), unk_token=unk, fuse_unk=True,
                       byte_fallback=bool(vocab.of_type(_BYTE)))
    tok = BackendTokenizer(model)
    prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _post_processor(vocab: _Vocabulary, add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
    bos, eos = vocab.token("bos_token_id"), vocab.token("eos_token_id")
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    ends = [(t, vocab.ids[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=list(dict.fromkeys(ends)))


def build_tokenizer(gguf: GGUFFile) -> tuple[BackendTokenizer, dict[str, Any]]:
    """The file's tokenizer as a `tokenizers` object, and the tokenizer_config.json to go with it."""
    kind = gguf.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise ValueError(f"{gguf.path.name}: tokenizer model {kind!r} is not supported "
                         f"(supported: {', '.join(sorted(_BUILDERS))})")
    vocab = _Vocabulary(gguf)
    tok = _BUILDERS[kind](vocab)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in vocab.of_type(_CONTROL)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in vocab.of_type(_USER_DEFINED)])
    bos, eos = vocab.token("bos_token_id"), vocab.token("eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tok.post_processor = _post_processor(vocab, add_bos, add_eos)
    arch = gguf.get("general.architecture")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": vocab.token("unknown_token_id"),
        "pad_token": vocab.token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.get(f"{arch}.context_length", 2048)),
    }
    template = gguf.get("tokenizer.chat_template")
    if template is None and arch == "gemma3" and _GEMMA_END_OF_TURN in vocab.ids:
        template = GEMMA_CHAT_TEMPLATE
    if template is not None:
        config["chat_template"] = template
    return tok, config


def end_of_turn_ids(gguf: GGUFFile) -> list[int]:
    """Token ids besides eos that end generation: Gemma's <end_of_turn>, which llama.cpp also stops at."""
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    if gguf.get("general.architecture") == "gemma3" and _GEMMA_END_OF_TURN in tokens:
        return [list(tokens).index(_GEMMA_END_OF_TURN)]
    return []
