"""Page keys: one identity per (salt, position, contents), the same in every process."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from lockstep.kv.page_keys import KEY_SIZE, key_salt, next_key, page_keys

SALT = key_salt("smollm2-135m", 4)


def test_only_full_pages_have_keys() -> None:
    assert page_keys([], 4, SALT) == []
    assert page_keys([1, 2, 3], 4, SALT) == []
    assert len(page_keys(list(range(8)), 4, SALT)) == 2
    assert page_keys(list(range(11)), 4, SALT) == page_keys(list(range(8)), 4, SALT)
    assert all(len(k) == KEY_SIZE for k in page_keys(list(range(12)), 4, SALT))


def test_keys_are_the_chain_of_next_key() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    k0 = next_key(None, tokens[0:4], SALT)
    k1 = next_key(k0, tokens[4:8], SALT)
    assert page_keys(tokens, 4, SALT) == [k0, k1]


def test_parent_continues_a_chain() -> None:
    tokens = list(range(100, 124))
    keys = page_keys(tokens, 4, SALT)
    assert page_keys(tokens[8:], 4, SALT, parent=keys[1]) == keys[2:]


def test_a_page_is_never_matched_at_another_position() -> None:
    page = [1, 2, 3, 4]
    first = page_keys(page, 4, SALT)[0]
    second = page_keys([9, 9, 9, 9] + page, 4, SALT)[1]
    assert first != second
    # Same page at the same position but after a different first page: different key too.
    assert page_keys([8, 8, 8, 8] + page, 4, SALT)[1] != second


def test_equal_prefixes_share_keys_and_diverge_after() -> None:
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], 4, SALT)
    b = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 1], 4, SALT)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_all_keys_of_a_long_sequence_are_distinct() -> None:
    keys = page_keys([0] * 4000, 4, SALT)
    assert len(set(keys)) == 1000


@pytest.mark.parametrize(
    "other",
    [key_salt("smollm2-135m-other", 4), key_salt("smollm2-135m", 8), key_salt("smollm2-135m", 4, "tenant-a")],
)
def test_salt_separates_models_page_sizes_and_namespaces(other: bytes) -> None:
    assert other != SALT
    tokens = list(range(8))
    assert set(page_keys(tokens, 4, SALT)).isdisjoint(page_keys(tokens, 4, other))


def test_salt_fields_are_length_prefixed() -> None:
    assert key_salt("ab", 4, "c") != key_salt("a", 4, "bc")


def test_key_encoding_is_the_documented_wire_format() -> None:
    """Another implementation (or another version of this one) must reproduce the keys byte for byte."""
    model, ns = "m", "ns"
    salt = hashlib.blake2b(
        struct.pack("<I", 1) + b"m" + struct.pack("<I", 4) + struct.pack("<I", 2) + b"ns",
        digest_size=32,
        person=b"lockstep-salt",
    ).digest()
    assert key_salt(model, 4, ns) == salt
    root = hashlib.blake2b(
        b"\x00" + struct.pack("<4I", 1, 2, 3, 70000), digest_size=32, key=salt, person=b"lockstep-page"
    ).digest()
    child = hashlib.blake2b(
        b"\x01" + root + struct.pack("<4I", 4, 5, 6, 7), digest_size=32, key=salt, person=b"lockstep-page"
    ).digest()
    assert page_keys([1, 2, 3, 70000, 4, 5, 6, 7], 4, salt) == [root, child]


def test_keys_do_not_depend_on_the_process_hash_seed() -> None:
    code = (
        "from lockstep.kv.page_keys import key_salt, page_keys;"
        "print(b''.join(page_keys(list(range(32)), 4, key_salt('m', 4, 'n'))).hex())"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == b"".join(page_keys(list(range(32)), 4, key_salt("m", 4, "n"))).hex()


def test_tuple_and_list_inputs_agree() -> None:
    assert page_keys((1, 2, 3, 4), 4, SALT) == page_keys([1, 2, 3, 4], 4, SALT)
    assert next_key(None, (1, 2), SALT) == next_key(None, [1, 2], SALT)


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2, -1, 4], r"token id -1 at index 2"),
        ([1, 2, 3, 2**32], r"token id 4294967296 at index 3"),
        ([1, 2.0, 3, 4], r"token at index 1 is 2.0"),
        ([1, True, 3, 4], r"token at index 1 is True"),
        ([1, "2", 3, 4], r"token at index 1 is '2'"),
    ],
)
def test_bad_tokens_are_named(tokens: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        page_keys(tokens, 4, SALT)
    with pytest.raises(ValueError, match=match):
        next_key(None, tokens, SALT)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        page_keys([1, 2], 0, SALT)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        key_salt("m", -4)
    with pytest.raises(ValueError, match="model_id must be a non-empty string"):
        key_salt("", 4)
    with pytest.raises(ValueError, match="namespace must be a string"):
        key_salt("m", 4, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="salt must be the 32 bytes"):
        page_keys([1, 2], 2, b"short")
    with pytest.raises(ValueError, match="salt must be the 32 bytes"):
        next_key(None, [1], "m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parent must be None or a 32-byte page key"):
        next_key(b"x", [1], SALT)
    with pytest.raises(ValueError, match="at least one token"):
        next_key(None, [], SALT)


def test_numpy_token_ids_give_the_same_keys() -> None:
    np = pytest.importorskip("numpy")
    tokens = list(range(40, 56))
    assert page_keys(np.array(tokens, dtype=np.int64), 4, SALT) == page_keys(tokens, 4, SALT)
