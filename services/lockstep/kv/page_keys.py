"""Page identity: the hash chain that names every full KV page, the same on the coordinator and every rank.

A page's key commits to the salt (model, page size, cache namespace), to every token before it (through its
parent's key) and to its own tokens, so equal keys mean equal contents at the same position. The encoding is
fixed (little-endian uint32 token ids, BLAKE2b) and never uses Python's `hash()`, which is randomised per
process: two processes must compute the same key for the same tokens or the ranks' probes stop agreeing.

Wire format, so that another implementation can reproduce it:
- salt = BLAKE2b-256(person=b"lockstep-salt", u32(len(m)) m u32(page_size) u32(len(n)) n),
  where m and n are the UTF-8 model id and namespace.
- key  = BLAKE2b-256(key=salt, person=b"lockstep-page", tag parent tokens): tag is b"\\x00" for the first
  page (no parent bytes) and b"\\x01" followed by the 32-byte parent key otherwise; tokens are u32 each.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_SIZE = 32
SALT_SIZE = 32
MAX_TOKEN_ID = 2**32 - 1

_SALT_PERSON = b"lockstep-salt"
_KEY_PERSON = b"lockstep-page"
_ROOT = b"\x00"
_CHILD = b"\x01"


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def key_salt(model_id: str, page_size: int, namespace: str = "") -> bytes:
    """The root salt: pages of different models, page sizes or namespaces never share a key."""
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    if type(page_size) is not int or not 1 <= page_size <= MAX_TOKEN_ID:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(namespace, str):
        raise ValueError(f"namespace must be a string, got {namespace!r}")
    payload = _field(model_id.encode()) + struct.pack("<I", page_size) + _field(namespace.encode())
    return hashlib.blake2b(payload, digest_size=SALT_SIZE, person=_SALT_PERSON).digest()


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    if not set(map(type, tokens)) <= {int}:
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise ValueError(f"token at index {i} is {t!r}, not an int")
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        bad = next((i, t) for i, t in enumerate(tokens) if not 0 <= int(t) <= MAX_TOKEN_ID)
        raise ValueError(f"token id {bad[1]} at index {bad[0]} is not in [0, {MAX_TOKEN_ID}]") from None


def _check_salt(salt: bytes) -> None:
    if not isinstance(salt, bytes) or len(salt) != SALT_SIZE:
        raise ValueError(f"salt must be the {SALT_SIZE} bytes of key_salt(), got {salt!r:.80}")


def _chain(parent: bytes | None, encoded: bytes, salt: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_SIZE, key=salt, person=_KEY_PERSON)
    if parent is None:
        h.update(_ROOT)
    else:
        h.update(_CHILD)
        h.update(parent)
    h.update(encoded)
    return h.digest()


def _check_parent(parent: bytes | None) -> None:
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_SIZE):
        raise ValueError(f"parent must be None or a {KEY_SIZE}-byte page key, got {parent!r:.80}")


def next_key(parent: bytes | None, page_tokens: Sequence[int], salt: bytes) -> bytes:
    """The key of the page holding `page_tokens` after the page keyed `parent` (None: the first page)."""
    _check_salt(salt)
    _check_parent(parent)
    if len(page_tokens) == 0:
        raise ValueError("a page key needs at least one token")
    return _chain(parent, _encode_tokens(page_tokens), salt)


def page_keys(
    token_ids: Sequence[int], page_size: int, salt: bytes, parent: bytes | None = None
) -> list[bytes]:
    """Keys of the full pages of `token_ids`; a trailing partial page has no key until it fills.

    `parent` continues a chain: keys of tokens[k*page_size:] with parent=keys[k-1] are keys[k:].
    """
    _check_salt(salt)
    _check_parent(parent)
    if type(page_size) is not int or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    full = len(token_ids) // page_size * page_size
    encoded = _encode_tokens(token_ids[:full])
    width = 4 * page_size
    keys: list[bytes] = []
    for start in range(0, len(encoded), width):
        parent = _chain(parent, encoded[start : start + width], salt)
        keys.append(parent)
    return keys
