"""The n choices of one request share its prompt's pages on a real TP-2 group (two `lockstep rank` processes,
gloo, the tiny Llama): the prompt is computed once, by the first choice, and every other choice waits for its
pages to be committed and skips them (the scheduler's prefix_sharing), without changing what any choice draws."""

from __future__ import annotations

import pytest

from checkpoints import random_prompt
from cluster import Cluster

PAGE = 16
FULL_PAGES = 5


@pytest.fixture(scope="module")
def group(tiny_llama, tmp_path_factory):
    c = Cluster(tiny_llama, tp=2, kv_pages=128, page_size=PAGE, log_dir=tmp_path_factory.mktemp("logs"))
    yield c
    c.close()


def _counter(group: Cluster, name: str, **labels: str) -> float:
    return sum(group.metric(name, **labels))


def test_n_choices_compute_the_prompt_once_and_draw_as_n_separate_requests(group):
    ids = random_prompt(1313, FULL_PAGES * PAGE + 3)  # a prompt no other test sends: nothing of it is cached
    body = {"prompt": ids, "max_tokens": 6, "temperature": 1.0, "seed": 77, "ignore_eos": True,
            "return_token_ids": True}
    hits = _counter(group, "lockstep_prefix_cache_hit_tokens_total")
    held = _counter(group, "lockstep_admission_deferred_total", reason="prefix_pending")
    status, answer = group.complete({**body, "n": 4})
    assert status == 200, answer
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == 4
    # choice 0 computes the whole prompt; the other three skip its full pages (all but the last 3 tokens)
    assert _counter(group, "lockstep_prefix_cache_hit_tokens_total") - hits == 3 * FULL_PAGES * PAGE
    assert _counter(group, "lockstep_admission_deferred_total", reason="prefix_pending") - held >= 3  # queued together
    group.assert_no_leak()
    for i, choice in enumerate(choices):  # choice i draws as an n=1 request with seed + i (choices.py)
        status, one = group.complete({**body, "seed": 77 + i})
        assert status == 200, one
        assert one["choices"][0]["token_ids"] == choice["token_ids"], i
    group.assert_no_leak()
