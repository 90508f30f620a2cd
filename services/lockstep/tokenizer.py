"""Text to token ids and back, for the coordinator.

The coordinator tokenizes every prompt and detokenizes every streamed token, but never runs the
model, so this module imports no torch and no transformers: `tokenizers` for the vocabulary and
`jinja2` (sandboxed, configured as Hugging Face configures it) for chat templates. The directory
layout it reads is a Hugging Face checkpoint's, and its results match transformers' `AutoTokenizer`
on the same directory.
"""

from __future__ import annotations

import codecs
import copy
import json
import reprlib
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# How many already-emitted tokens an incremental decode keeps in front of the new ones: some
# decoders (Metaspace, WordPiece) render a token differently at the start of a string.
_PROMPT_TAIL = 64  # prompt ids an IncrementalDecoder looks back over (its window reads at most 8 of them)
_DECODE_CONTEXT = 5


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table: printable bytes stand for themselves, the
    others for the characters from U+0100 on), inverted."""
    own = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    others = [b for b in range(256) if b not in own]
    return {chr(b): b for b in own} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_chars()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or a serialized AddedToken."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"a special token must be a string or an AddedToken object, not {value!r}")


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return set(value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, not {value!r}")


def _select_template(value: Any) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of named templates (use 'default')."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    raise ValueError(f"chat_template must be a string or a list of named templates, "
                     f"not {type(value).__name__}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Templates are untrusted code from a checkpoint, so they run sandboxed and immutable."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, chat template, and the ids that end a generation."""

    def __init__(self, backend: _BackendTokenizer, special_tokens: dict[str, str | None],
                 chat_template: str | None, eos_token_ids: set[int], source: str = "<memory>"):
        self._backend = backend
        self._source = source
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self._model_vocab = 1 << 62
        self.bos_token_id: int | None = self._id_of(special_tokens.get("bos_token"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and the eos ids of generation_config/config.

        Whether encode() adds bos/eos is tokenizer.json's post-processor alone: transformers 5
        ignores tokenizer_config.json's add_bos_token/add_eos_token when tokenizer.json exists.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json (a Hugging Face fast-tokenizer file is required)")
        try:
            backend = _BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ValueError(f"cannot load {tokenizer_file}: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        special = {name: _token_content(config.get(name)) for name in _SPECIAL_NAMES}

        template = _select_template(config.get("chat_template"))
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")

        eos_ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos_ids |= _as_id_set(_read_json(path / name).get("eos_token_id"))
        tokenizer = cls(backend, special, template, eos_ids, source=str(path))
        eos_id = tokenizer._id_of(special.get("eos_token"))
        if eos_id is not None:
            tokenizer.eos_token_ids.add(eos_id)
        return tokenizer

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (the model's vocab may be padded larger), and the
        model can read (`for_model`)."""
        return min(self._backend.get_vocab_size(with_added_tokens=True), self._model_vocab)

    def for_model(self, model_vocab: int) -> Tokenizer:
        """This tokenizer limited to the ids a model of `model_vocab` embeddings reads: an id past them (a tokenizer
        larger than its config's vocab_size) is refused at the API, not an index error in every rank's forward. A
        copy (sharing the backend): the tokenizer it came from keeps its own range."""
        limited = copy.copy(self)
        limited._model_vocab = model_vocab
        return limited

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"can only encode a string, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, releasing the GIL while it runs (the backend's batch call does, its single call does not):
        for a thread, so that the event loop goes on while a text of megabytes is encoded."""
        if not isinstance(text, str):
            raise ValueError(f"can only encode a string, not {type(text).__name__}")
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's own piece for an id (with its space marker), None outside the vocabulary."""
        return self._backend.id_to_token(token_id)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        self._check_ids(ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_unlocked(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """`decode`, releasing the GIL while the backend runs (its batch call does, its single call does not): for a
        thread, so that the event loop goes on while millions of ids are decoded."""
        ids = list(ids)
        self._check_ids(ids)
        return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs `bytes`, which rebuild the text when concatenated): a
        character split over tokens has some of its bytes in each, where the token's text alone is U+FFFD."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback: <0xE4>
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return piece.replace("\u2581", " ").encode()  # a Metaspace piece ("▁Paris"), or an added token

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The special tokens' ids: what `decode` drops when it skips special tokens."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps each character of a piece to a byte (GPT-2's byte-level BPE)."""
        return '"ByteLevel"' in json.dumps(json.loads(self._backend.to_str()).get("decoder"))

    def _check_ids(self, ids: list[int]) -> None:
        limit = self.vocab_size
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < limit:
                raise ValueError(f"token id {reprlib.repr(i)} is outside the vocabulary [0, {limit})")  # cut short

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer in {self._source} has no chat template "
                             "(tokenizer_config.json has no 'chat_template' and there is no "
                             "chat_template.jinja)")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of objects with 'role' and 'content'")
        template = _compile_template(self.chat_template)
        variables = {name: token for name, token in self.special_tokens.items() if token is not None}
        variables.update(kwargs)
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template rejected the conversation: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"the chat template failed on the conversation: {type(e).__name__}: {e}") from e


def _continues(data: bytes) -> bool:
    """Whether these bytes begin inside a UTF-8 character (with a continuation byte)."""
    return bool(data) and data[0] & 0xC0 == 0x80


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces whose concatenation equals `decode` of them all.

    A byte-level token can end in the middle of a multi-byte character; the piece is held back
    until the character is complete, so a client never receives a replacement character that the
    full decode would not have. Decoding starts before the new tokens because some decoders render a
    token differently at the start of a string (a Metaspace decoder strips its space): a few prompt
    tokens back at first, then where the last piece began. That is a character's edge, which matters:
    a byte-fallback decoder makes a run of byte tokens that is not UTF-8 as a whole one U+FFFD per byte,
    so a window begun inside a character spoilt every character after it (vLLM moves its window so).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        tail = list(prompt_ids[-_PROMPT_TAIL:])
        tokenizer._check_ids(tail)
        if skip_special_tokens:  # they decode to nothing: a window counts the tokens that make text
            tail = [i for i in tail if i not in tokenizer.special_ids]
        self._ids: list[int] = tail[-(_DECODE_CONTEXT + 3):]  # all a window reads of a long prompt
        self._read = len(self._ids)
        self._prefix = max(self._read - _DECODE_CONTEXT, 0)
        # A prompt given as ids may end inside a character that the generated bytes complete: the tokens
        # holding its first bytes belong to the first piece. Counted in bytes, not by a trailing U+FFFD:
        # that may be a broken byte no later one completes, and stepping over it cut a character in two.
        held = codecs.getincrementaldecoder("utf-8")("replace")
        held.decode(b"".join(tokenizer.token_bytes(i) for i in self._ids))
        unfinished = len(held.getstate()[0])
        while unfinished > 0 and self._read > 0:
            self._read -= 1
            unfinished -= len(tokenizer.token_bytes(self._ids[self._read]))
        self._prefix = min(self._prefix, self._read)
        # a window that starts a few tokens back starts inside the prompt's text, maybe inside a character (a
        # byte-fallback decoder then makes every byte of the run U+FFFD): from the next character's first byte
        start = self._prefix
        while 0 < start < self._read and _continues(tokenizer.token_bytes(self._ids[start])):
            start += 1
        # up to the read point, the run is either the end of a character before an unfinished one (the window then
        # starts with that one's first byte) or stray bytes, no character at all: an empty window would lose the
        # space a Metaspace decoder strips off the first piece, so the window keeps them
        if start < self._read or self._read < len(self._ids):
            self._prefix = start
        self._prompt_end = len(self._ids)  # no generated token yet: nothing to say, however the prompt ends

    def _window(self, end: int) -> str:
        return self._tokenizer._backend.decode(self._ids[self._prefix:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self._tokenizer._check_ids([token_id])
        self._ids.append(token_id)
        before = self._window(self._read)
        after = self._window(len(self._ids))
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """The text still held back at the end of the stream (an unfinished character decodes as U+FFFD)."""
        if len(self._ids) == self._prompt_end:  # the prompt's own unfinished bytes are not this stream's text
            return ""
        before = self._window(self._read)
        after = self._window(len(self._ids))
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]
