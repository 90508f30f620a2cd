"""A group of three ranks, as `lockstep serve` runs the built-in model on a small machine: real `lockstep rank`
processes over gloo, a `lockstep coordinator`, a checkpoint that splits three ways (6 heads, 3 KV heads)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from checkpoints import random_prompt as prompt
from cluster import Cluster, hf_greedy, http, tokens_of

RANK_PAGES = [80, 64, 48]  # every rank's own pool: admission must fit the smallest


@pytest.fixture(scope="module")
def tp3_model(checkpoint_dir):
    return checkpoint_dir("llama_tp3")


@pytest.fixture(scope="module")
def reference(tp3_model):
    return hf_greedy(tp3_model)


@pytest.fixture(scope="module")
def group(tp3_model, tmp_path_factory):
    c = Cluster(tp3_model, tp=3, kv_pages=RANK_PAGES, log_dir=tmp_path_factory.mktemp("logs"))
    yield c
    c.close()


def test_three_ranks_decode_as_transformers_with_shared_prefixes(group, reference, no_leak):
    shared = prompt(10, 40)
    tokens_of(group, shared + prompt(11, 3), 1)  # the shared prefix's pages cached on every rank
    prompts = [shared + prompt(20 + i, n) for i, n in enumerate([4, 9, 17])] + [prompt(30, 23), prompt(31, 6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: tokens_of(group, p, 10), prompts))
    for p, (got, _) in zip(prompts, results, strict=True):
        assert got == reference(p, 10)
    assert [body["usage"]["prompt_tokens_details"]["cached_tokens"] for _, body in results[:3]] == [32, 32, 32]


def test_a_flushed_rank_makes_all_three_skip_only_what_it_still_holds(group, reference, no_leak):
    p = prompt(40, 50)
    tokens_of(group, p, 2)
    status, _ = http("POST", group.url + "/admin/reset_prefix_cache?rank=2")
    assert status == 200
    got, body = tokens_of(group, p, 6)
    assert got == reference(p, 6)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # rank 2 holds none: the minimum


def test_admission_fits_the_smallest_rank(group, reference, no_leak):
    """Six requests of 11 pages each (66) fit the smallest rank's 48 pages four at a time, the largest's 80 all at
    once: admitted by the largest, a rank would refuse the step (`no_leak` checks none did); every one is served
    in full."""
    prompts = [prompt(50 + i, 150) for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: tokens_of(group, p, 12)[0], prompts))
    assert results == [reference(p, 12) for p in prompts]
