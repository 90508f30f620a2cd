"""Prompts encoded, and chats rendered, off the event loop when they are long.

A prompt of a few MB takes seconds to encode; on the event loop that stalled every other client's stream (and,
with the API in the coordinator's process, the step loop). The tokenizer's batch call releases the GIL, so a
thread encodes it while the loop goes on.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lockstep.tokenizer import Tokenizer

T = TypeVar("T")
OFF_LOOP_CHARS = 1 << 15  # a text this long takes about a millisecond or more to encode
_OFF_LOOP: list[ThreadPoolExecutor] = []  # made on first use


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`: here when `size` (the characters or ids it works through) is small, else in the one thread that
    encodes and renders long prompts, one at a time (as vLLM's tokenizer executor): six 4 MB prompts at once on as
    many threads took the cores from the ranks' forward."""
    if size <= OFF_LOOP_CHARS:
        return fn(*args)
    if not _OFF_LOOP:
        _OFF_LOOP.append(ThreadPoolExecutor(1, thread_name_prefix="lockstep-prompts"))
    return await asyncio.get_running_loop().run_in_executor(_OFF_LOOP[0], functools.partial(fn, *args))


async def encode_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids; a long one encoded off the event loop: a 4 MB prompt takes seconds, which on the
    loop stalled every other client's stream (and, in one process, the step loop)."""
    if len(text) <= OFF_LOOP_CHARS:  # the single call, which holds the GIL, is ~8% faster for a short text
        return tokenizer.encode(text, add_special_tokens)
    return await off_loop(len(text), tokenizer.encode_unlocked, text, add_special_tokens)
