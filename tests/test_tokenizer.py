"""The coordinator's tokenizer against transformers' AutoTokenizer on the same directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.tokenizer import IncrementalDecoder, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!",
    "Lockstep serves a language model split across ranks; every rank agrees on every step.",
    "café, naïve, résumé, über, señor, façade, déjà vu",
    "numbers 0123456789 and symbols + - * / = ( ) [ ] { } < > ; : , . ? !",
    "Hello world\n\n  indented line\ttab",
]
# Each line is a block tag on its own, indented: trim_blocks/lstrip_blocks decide every newline.
CHAT_TEMPLATE = """{% if messages[0]['role'] != 'system' %}
{{ bos_token }}system
You are terse.{{ eos_token }}
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
{{ bos_token + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}
{% endfor %}
{% if add_generation_prompt %}
{{ bos_token }}assistant
{% endif %}"""
TEXTS = [
    "The quick brown fox",
    "  two leading spaces, and trailing  ",
    "café résumé déjà vu über",
    "emoji 🎉🚀 and 日本語 and Ωmega",
    "<|im_start|>user\nhello<|im_end|>",
    "digits 31415926 and\n\nnewlines\r\n",
    "",
]


def _train(path: Path, config: dict) -> Path:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A small vocabulary: accented letters, emoji and CJK stay split into single bytes.
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = _train(tmp_path_factory.mktemp("tok"), {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True, "lstrip": False,
                      "rstrip": False, "normalized": False, "single_word": False},
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    })
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return path


@pytest.fixture(scope="module")
def ours(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, hf, text: str) -> None:
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == hf.encode(text, add_special_tokens=special)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_tokens_and_sizes(ours: Tokenizer, hf) -> None:
    assert ours.vocab_size == len(hf) == 320
    assert ours.bos_token == "<|im_start|>" and ours.eos_token == "<|im_end|>"
    assert ours.encode("<|im_end|>") == [2]  # an added token is matched whole, never cut into bytes
    assert ours.decode(ours.encode("a<|im_end|>b")) == "ab"
    # eos from tokenizer_config (2) united with generation_config's list (0, 2)
    assert ours.eos_token_ids == {0, 2}


def test_bos_eos_follow_tokenizer_json_like_transformers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors
    from transformers import AutoTokenizer

    # The config's add_bos_token=False is overruled by tokenizer.json's post-processor, as in transformers 5.
    path = _train(tmp_path / "bos", {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                     "add_bos_token": False})
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)])
    backend.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    ours, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))
    ids = ours.encode("The fox")
    assert ids[0] == 1 and ids[-1] == 2
    assert ids == hf.encode("The fox")
    assert ours.encode("The fox", add_special_tokens=False) == hf.encode("The fox", add_special_tokens=False)
    assert ours.bos_token_id == 1
    assert ours.eos_token_ids == {0, 2}


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, hf, generation_prompt: bool) -> None:
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🎉"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "café?"}],
    ]
    for messages in conversations:
        text = ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        assert text == hf.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=generation_prompt)
        assert ours.encode(text, add_special_tokens=False) == hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False)
    # The stripped block tags leave no stray indentation or blank lines.
    assert ours.apply_chat_template(conversations[0]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
        "<|im_end|>\n\n<|im_start|>assistant\n")


def test_template_errors_are_value_errors(ours: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="list of objects"):
        ours.apply_chat_template("hello")  # type: ignore[arg-type]
    bare = Tokenizer.from_dir(_train(tmp_path / "bare", {"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    broken = _train(tmp_path / "broken", {"chat_template": "{% for m in messages %}{{ m }"})
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_dir(broken).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_is_sandboxed(tmp_path: Path) -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer.from_dir(_train(tmp_path / "evil", {"chat_template": escape}))
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_input_errors(ours: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([5, 320])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([-1])
    with pytest.raises(ValueError, match="only encode a string"):
        ours.encode(["a"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    path = _train(tmp_path / "badcfg", {})
    (path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        Tokenizer.from_dir(path)


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    decoder = IncrementalDecoder(tok, prompt or [])
    pieces = [decoder.add(i) for i in ids]
    return pieces + [decoder.flush()]


@pytest.mark.parametrize("text", ["emoji 🎉🚀 done", "café déjà vu über", "日本語のテキスト", "Ωmega → ∞ 🇫🇷"])
def test_incremental_decoder_never_splits_a_character(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    # The case is real: some single tokens of this text are not whole characters on their own.
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    pieces = _stream(ours, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == ours.decode(ids)
    # With a prompt in front, only the new text comes out.
    prompt = ours.encode("The fox says ", add_special_tokens=False)
    assert "".join(_stream(ours, ids, prompt)) == text


def test_incremental_decoder_skips_special_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>hi 🎉<|im_end|>", add_special_tokens=False)
    assert "".join(_stream(ours, ids)) == "hi 🎉" == ours.decode(ids)
    keep = IncrementalDecoder(ours, skip_special_tokens=False)
    kept = "".join([keep.add(i) for i in ids] + [keep.flush()])
    assert kept == ours.decode(ids, skip_special_tokens=False) == "<|im_start|>hi 🎉<|im_end|>"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 319), max_size=40), prompt=st.lists(st.integers(0, 319), max_size=8))
def test_incremental_decoder_concatenation_equals_decode(ours: Tokenizer, ids: list[int],
                                                         prompt: list[int]) -> None:
    pieces = _stream(ours, ids, prompt)
    joined, full = "".join(pieces), ours.decode(prompt + ids)
    # The pieces are exactly the text the generated ids add to the prompt's text. When the prompt ends
    # inside a character that the generated bytes complete, that character comes out whole (its first
    # bytes may be a few tokens back, special tokens between them: [129, 0, 0, 0] then [97] is '¡').
    starts = [len(prompt)] if not ours.decode(prompt).endswith("\ufffd") else range(len(prompt) + 1)
    assert any(full == ours.decode(prompt[:k]) + joined for k in starts)
    # A piece that would end in an unfinished character is held back; only flush() may end in one.
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])


@pytest.mark.parametrize("specials", [1, 3, 6, 12])
def test_a_character_begun_in_the_prompt_before_special_tokens_is_completed_whole(ours: Tokenizer,
                                                                                    specials: int) -> None:
    """Found by hypothesis in CI: a prompt's last byte token, special tokens after it, then the byte that
    completes the character streamed U+FFFD; `decode` of it all gives the character."""
    prompt, ids = [129] + [0] * specials, [97]
    assert ours.decode(prompt + ids) == "\u00a1" and ours.decode([0]) == "" and 0 in ours.special_ids
    assert "".join(_stream(ours, ids, prompt)) == "\u00a1"


def test_incremental_decoder_completes_a_character_begun_in_the_prompt(ours: Tokenizer) -> None:
    ids = ours.encode("Ω", add_special_tokens=False)
    assert len(ids) == 2  # two byte tokens
    decoder = IncrementalDecoder(ours, ids[:1])
    assert decoder.add(ids[1]) == "Ω"


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Llama-style tokenizer (Gemma's and Llama's GGUF ones are alike): Metaspace pieces, byte fallback (a
    character it has no piece for is one <0xNN> token per UTF-8 byte), and a decoder that strips the space the
    text's first piece starts with."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{i:02X}>", -10.0) for i in range(256)]
    vocab += [(w, -1.0) for w in ["\u2581", "\u2581The", "\u2581capital", "\u2581of", "\u2581is", "\u2581Paris", ".",
                                  "\u2581ok"]]
    backend = Backend(models.Unigram(vocab, 0, True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    path = tmp_path_factory.mktemp("sentencepiece")
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer.from_dir(path)


@pytest.mark.parametrize("text", ["你好世界和平", "😀😀😀 ok", "日本語のテキスト", "ok 你A好 ok"])
def test_byte_fallback_characters_come_out_whole_however_many_follow(sentencepiece: Tokenizer, text: str) -> None:
    """With byte fallback a character is three or four tokens, and the decoder turns a run of bytes that is not
    UTF-8 as a whole into one U+FFFD per byte. A decode window that started five tokens back (inside a character)
    therefore made every later character U+FFFD: the window now starts where a piece began, a character's edge."""
    prompt = sentencepiece.encode("The capital of", add_special_tokens=False)
    ids = sentencepiece.encode(text, add_special_tokens=False)  # as generated after the prompt: "▁" first
    assert sum(sentencepiece._backend.id_to_token(i).startswith("<0x") for i in ids) >= 6  # bytes, not pieces
    pieces = _stream(sentencepiece, ids, prompt)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == " " + text
    assert sentencepiece.decode(prompt + ids) == "The capital of " + text


@pytest.mark.parametrize("text", ["你好", "😀😀", "ok 你好"])
def test_a_short_prompt_whose_window_starts_inside_a_byte_fallback_character_streams_whole_characters(
        sentencepiece: Tokenizer, text: str) -> None:
    """The decode window starts a few tokens back (`_DECODE_CONTEXT`): with a short prompt of byte tokens that is
    inside a character, and a byte-fallback decoder made the whole run U+FFFD, so every later piece was held back
    and flush() gave one U+FFFD per generated byte instead of the text."""
    prompt = sentencepiece.encode(text, add_special_tokens=False)
    ids = sentencepiece.encode("世界", add_special_tokens=False)[1:]  # the bytes alone, no leading "▁"
    assert len(prompt) <= 64 and sentencepiece.decode(prompt + ids) == text + "世界"
    pieces = _stream(sentencepiece, ids, prompt)
    assert "".join(pieces) == "世界" and not any("\ufffd" in p for p in pieces)


def test_stray_bytes_at_a_prompts_end_do_not_take_the_next_pieces_space(sentencepiece: Tokenizer) -> None:
    """Moving the window past a leading run of continuation bytes must stop at a character: moved up to the read
    point over stray bytes (no character at all), the window was empty and " Paris" streamed as "Paris"."""
    byte = lambda b: 3 + b  # noqa: E731 -- the fixture's <0xNN> tokens follow its three special ones
    paris = sentencepiece.encode("Paris", add_special_tokens=False)
    prompt = [byte(0xB1), *sentencepiece.encode("中", add_special_tokens=False), byte(0x9F), byte(0x98), byte(0x80)]
    assert "".join(_stream(sentencepiece, paris, prompt)) == " Paris"


def test_the_first_generated_piece_keeps_its_space_after_the_prompt(sentencepiece: Tokenizer) -> None:
    """A Metaspace decoder strips the space a text begins with: decoded alone, " Paris" is "Paris". The generated
    text is what it adds to the prompt's, as vLLM gives it, so the request's text decodes with the prompt."""
    import asyncio

    from lockstep.coordinator.generation import GenerateSpec, TokenEvent, collect, text_stream
    from lockstep.coordinator.request import FinishReason
    from lockstep.steps import SamplingParams

    prompt = sentencepiece.encode("The capital of", add_special_tokens=False)
    ids = sentencepiece.encode("Paris.", add_special_tokens=False)  # "▁Paris", "."
    assert sentencepiece.decode(ids) == "Paris."
    assert "".join(_stream(sentencepiece, ids, prompt)) == " Paris."

    async def events():
        for k, t in enumerate(ids):
            yield TokenEvent(t, FinishReason.LENGTH if k == len(ids) - 1 else None)

    done = asyncio.run(collect(text_stream(sentencepiece, GenerateSpec(prompt, SamplingParams(), len(ids)), events())))
    assert done.text == " Paris."


def test_no_torch_or_transformers_import(tok_dir: Path) -> None:
    code = ("import sys; from lockstep.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_dir({str(tok_dir)!r}); "
            "t.apply_chat_template([{'role': 'user', 'content': 'x'}]); "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_tokens_bytes_rebuild_the_text_where_its_text_alone_is_a_replacement_character(
        ours: Tokenizer, sentencepiece: Tokenizer) -> None:
    """OpenAI's chat logprobs `bytes` concatenate to the text. A token holding part of a character decodes alone as
    U+FFFD, whose UTF-8 is not its bytes: they come from the token itself (byte-level BPE's stand-in characters,
    byte fallback's <0xNN>, Metaspace's ▁ as a space)."""
    from lockstep.coordinator.openai_output import Shape, render_logprobs
    from lockstep.steps import TokenLogprobs

    for tok, text in ((ours, "emoji 🎉🚀 done, 日本語"), (sentencepiece, "ok 你A好 😀")):
        ids = tok.encode(text, add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i]) for i in ids)  # the case is real
        rebuilt = b"".join(tok.token_bytes(i) for i in ids)
        assert rebuilt.decode().lstrip(" ") == tok.decode(ids) == text
        lps = [TokenLogprobs(-1.0, ((i, -1.0),)) for i in ids]
        out, _ = render_logprobs(tok, Shape(chat=True, logprobs=1), ids, lps, 0)
        assert bytes(b for entry in out["content"] for b in entry["bytes"]) == rebuilt
        assert [e["top_logprobs"][0]["bytes"] for e in out["content"]] == [list(tok.token_bytes(i)) for i in ids]


def test_a_tokenizer_for_a_smaller_model_refuses_the_ids_the_model_cannot_read(tok_dir: Path) -> None:
    """A config.json whose vocab_size is below the tokenizer's: an id past it was taken at the API and failed every
    rank's embedding (a 503 for the client, a refused step for the group). The served tokenizer is limited to the
    model's ids, so the API's range checks (prompt ids, stop_token_ids, logit_bias, /detokenize) refuse it."""
    from types import SimpleNamespace

    from lockstep.coordinator.generation import ApiError, SamplingFields, build_spec

    tok = Tokenizer.from_dir(tok_dir)
    full = tok.vocab_size
    assert Tokenizer.from_dir(tok_dir).for_model(full + 64).vocab_size == full  # a padded embedding: the tokenizer's
    small = tok.for_model(256)
    assert small.vocab_size == 256 < full == tok.vocab_size  # a limited copy: the tokenizer it came from is whole
    model = SimpleNamespace(model_name="m", tokenizer=small, max_model_len=64)
    with pytest.raises(ApiError, match=r"prompt token ids must be in \[0, 256\)"):
        build_spec(model, SamplingFields(), [5, 300, 7])
    with pytest.raises(ValueError):
        small.decode([300])
    build_spec(model, SamplingFields(), [5, 255, 7])


def test_a_stream_of_no_tokens_says_nothing_however_its_prompt_ends(ours: Tokenizer) -> None:
    """Found by hypothesis in CI: a prompt of four byte tokens that are no character ([175, 97, 97, 127]) and no
    generated token flushed three U+FFFD, text the full decode does not hold."""
    assert _stream(ours, [], [175, 97, 97, 127]) == [""]


@pytest.mark.parametrize(("prompt", "ids", "text"), [
    ([175, 256, 249, 225, 226, 141], [108], "ά"),  # bytes F0 9F 98 80 (😀), 81 (broken), CE; then AC: 'ά'
    ([138, 179, 233, 110, 124, 226, 141], [108, 160, 126, 201, 120], "ά\ufffd\n\ufffd"),  # as the search found it
])
def test_a_broken_byte_before_a_prompts_unfinished_character_stays_in_the_prompt(
        ours: Tokenizer, prompt: list[int], ids: list[int], text: str) -> None:
    """Found by a random search: the decoder stepped back over every trailing U+FFFD of the prompt, past the
    lone byte 81 into the 4-byte character before it, and streamed that character's last bytes as U+FFFD."""
    assert ours.decode(prompt + ids) == ours.decode(prompt[:-1]) + text
    assert "".join(_stream(ours, ids, prompt)) == text
