"""Paged attention and the paged KV cache: chunked prefill, mixed batches and reused prefix pages give
the logits of one plain forward, at TP 1 on the tiny checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.model.attention import AttentionBatch, paged_attention, write_kv
from lockstep.model.config import ModelConfig
from lockstep.model.kv_cache import KVCache
from lockstep.model.loader import load_model
from lockstep.parallel.comm import single_comm
from lockstep.parallel.sharding import TPConfigError

PS = 4
TOL = 5e-5  # fp32 rounding between batch layouts (GEMM kernels differ by row count); parity with HF is 1e-4


@pytest.fixture(scope="module")
def models(checkpoint_dir):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = load_model(checkpoint_dir(kind), single_comm(), "cpu")
        return cache[kind]

    return get


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed))


def new_cache(model, pages: int = 40) -> KVCache:
    return KVCache.create(model.config, 1, pages, PS, torch.float32, "cpu")


def full_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits from one forward over the whole sequence, in fresh contiguous pages."""
    kv = new_cache(model)
    return model(ids, AttentionBatch.build([(0, len(ids), range(40))], PS), kv, all_logits=True)


def dense_attention(q, k, v, start, window, scale):
    """Attention written out position by position: the definition the paged version must meet."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for j in range(q.shape[0]):
        pos = start + j
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            keys, vals = k[lo: pos + 1, h // group], v[lo: pos + 1, h // group]
            weights = torch.softmax(keys @ q[j, h] * scale, dim=0)
            out[j, h] = weights @ vals
    return out


MIXED = [(0, 9), (13, 1), (5, 6), (0, 1), (21, 3)]  # prefill, decode, later chunk, 1-token prompt, ...
# Many decode tokens, one of them far longer than the rest: the batched decode path splits them into
# groups by KV length, so this checks the grouping and its padding masks against the definition.
DECODES = [(s, 1) for s in (0, 3, 17, 40, 41, 64, 90, 120, 150, 200, 300, 900)]


@pytest.mark.parametrize("spans", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("window", [None, 3, 6, 50])
def test_paged_attention_meets_its_definition_on_a_mixed_batch(window, spans):
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d = 4, 2, 8
    pages = sum(math.ceil((s + n) / PS) for s, n in spans) + 5
    perm = torch.randperm(pages, generator=gen).tolist()
    k_cache = torch.zeros(pages, PS, kv_heads, d)
    v_cache = torch.zeros(pages, PS, kv_heads, d)
    tables, histories, queries = [], [], []
    for start, n in spans:
        need = math.ceil((start + n) / PS)
        tables.append([perm.pop() for _ in range(need)])
        histories.append((torch.randn(start + n, kv_heads, d, generator=gen),
                          torch.randn(start + n, kv_heads, d, generator=gen)))
        queries.append(torch.randn(n, heads, d, generator=gen))
    # The history before each chunk is already in the cache; the chunk's own k/v goes in via write_kv.
    past = AttentionBatch.build([(0, s, t) for (s, _), t in zip(spans, tables, strict=True) if s > 0], PS)
    write_kv(torch.cat([h[0][:s] for (s, _), h in zip(spans, histories, strict=True) if s > 0]),
             torch.cat([h[1][:s] for (s, _), h in zip(spans, histories, strict=True) if s > 0]),
             k_cache, v_cache, past)
    batch = AttentionBatch.build([(s, n, t) for (s, n), t in zip(spans, tables, strict=True)], PS)
    write_kv(torch.cat([h[0][s:] for (s, _), h in zip(spans, histories, strict=True)]),
             torch.cat([h[1][s:] for (s, _), h in zip(spans, histories, strict=True)]),
             k_cache, v_cache, batch)
    out = paged_attention(torch.cat(queries), k_cache, v_cache, batch, window, 0.3)
    expected = torch.cat([dense_attention(q, k, v, s, window, 0.3)
                          for q, (k, v), (s, _) in zip(queries, histories, spans, strict=True)])
    assert (out - expected).abs().max().item() < TOL


def test_batch_build_flattens_without_padding():
    b = AttentionBatch.build([(0, 3, [5]), (6, 1, [2, 9]), (2, 4, [7, 1])], PS)
    assert b.positions.tolist() == [0, 1, 2, 6, 2, 3, 4, 5]
    assert b.slot_mapping.tolist() == [20, 21, 22, 9 * PS + 2, 30, 31, 4, 5]
    assert b.query_offsets.tolist() == [0, 3, 4, 8]
    assert b.kv_lens.tolist() == [3, 7, 6]
    assert b.last_token_indices.tolist() == [2, 3, 7]
    assert b.block_tables.tolist() == [[5, -1], [2, 9], [7, 1]]


@pytest.mark.parametrize(("spans", "message"), [
    ([(0, 5, [1])], "sequence 0: page table has 1 pages but positions [0, 5) need 2"),
    ([(0, 2, [1]), (3, 0, [1])], "sequence 1: start must be >= 0 and n >= 1"),
    ([(-1, 2, [1])], "start must be >= 0"),
    ([(0, 2, [-3])], "negative page id"),
    ([], "at least one sequence"),
])
def test_batch_build_refuses_bad_spans(spans, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        AttentionBatch.build(spans, PS)


@pytest.mark.parametrize("kind", ["llama_gqa", "sliding"])
def test_chunked_prefill_then_decode_equals_one_forward(kind, models):
    model = models(kind)
    ids = tokens(30, 1)
    expected = full_forward(model, ids)
    kv = new_cache(model)
    table = [17, 3, 30, 8, 0, 25, 11, 39]
    pos, got = 0, []
    for n in [7, 1, 12, 5, 1, 1, 1, 1, 1]:  # chunk boundaries off the page boundaries, then decode
        batch = AttentionBatch.build([(pos, n, table)], PS)
        got.append(model(ids[pos: pos + n], batch, kv, all_logits=True))
        pos += n
    assert pos == len(ids)
    assert (torch.cat(got) - expected).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["qwen2_bias_tied", "sliding"])
def test_mixed_batch_equals_each_sequence_alone(kind, models):
    model = models(kind)
    a, b, c = tokens(11, 2), tokens(14, 3), tokens(12, 4)
    tables = {"a": [0, 1, 2], "b": [10, 11, 12, 13], "c": [20, 21, 22]}
    kv = new_cache(model)
    # b holds 13 tokens and decodes its 14th; c holds 6 and runs a 6-token chunk; a is a fresh prompt.
    model(b[:13], AttentionBatch.build([(0, 13, tables["b"])], PS), kv)
    model(c[:6], AttentionBatch.build([(0, 6, tables["c"])], PS), kv)
    alone_kv = KVCache([k.clone() for k in kv.k], [v.clone() for v in kv.v], PS)
    spans = [(0, 11, tables["a"]), (13, 1, tables["b"]), (6, 6, tables["c"])]
    ids = torch.cat([a, b[13:], c[6:]])
    mixed = model(ids, AttentionBatch.build(spans, PS), kv)
    alone = torch.cat([
        model(a, AttentionBatch.build([spans[0]], PS), alone_kv),
        model(b[13:], AttentionBatch.build([spans[1]], PS), alone_kv),
        model(c[6:], AttentionBatch.build([spans[2]], PS), alone_kv),
    ])
    assert mixed.shape == (3, 384)
    assert (mixed - alone).abs().max().item() < TOL
    for k_mixed, k_alone in zip(kv.k, alone_kv.k, strict=True):
        assert (k_mixed - k_alone).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_bias_tied", "sliding"])
def test_reused_prefix_pages_give_the_logits_of_a_fresh_compute(kind, models):
    model = models(kind)
    shared = tokens(16, 5)
    first = torch.cat([shared, tokens(7, 6)])
    second = torch.cat([shared, tokens(9, 7)])
    kv = new_cache(model)
    table_first = [4, 9, 2, 31, 18, 7]
    model(first, AttentionBatch.build([(0, len(first), table_first)], PS), kv)
    reused_pages = 16 // PS
    table_second = table_first[:reused_pages] + [33, 12, 27]
    reused = model(second[16:], AttentionBatch.build([(16, 9, table_second)], PS), kv, all_logits=True)
    fresh = full_forward(model, second)[16:]
    assert (reused - fresh).abs().max().item() < TOL
    # The shared pages were only read: the first sequence still decodes as if alone.
    nxt = tokens(1, 8)
    again = model(nxt, AttentionBatch.build([(len(first), 1, table_first)], PS), kv)
    assert (again - full_forward(model, torch.cat([first, nxt]))[-1:]).abs().max().item() < TOL


def test_forward_refuses_a_batch_that_does_not_fit(models):
    model = models("llama_gqa")
    kv = new_cache(model)
    with pytest.raises(ValueError, match="input_ids has shape"):
        model(tokens(3, 0), AttentionBatch.build([(0, 4, [0])], PS), kv)
    small = KVCache.create(model.config, 1, 2, PS, torch.float32, "cpu")
    with pytest.raises(ValueError, match="page 5 of this batch is past the cache's 2 pages"):
        model(tokens(4, 0), AttentionBatch.build([(0, 4, [5])], PS), small)
    wrong = KVCache.create(model.config, 1, 4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="page size 8"):
        model(tokens(4, 0), AttentionBatch.build([(0, 4, [0])], PS), wrong)


def llama(**changes) -> ModelConfig:
    d = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 384}
    return ModelConfig.from_hf({**d, **changes})


def test_kv_cache_shapes_and_budget():
    cfg = llama()
    kv = KVCache.create(cfg, 2, 10, 16, torch.float32, "cpu")
    assert len(kv.k) == len(kv.v) == 3
    assert kv.k[0].shape == (10, 16, 1, 16)
    replicated = KVCache.create(cfg, 4, 10, 16, torch.bfloat16, "cpu")
    assert replicated.k[0].shape == (10, 16, 1, 16) and replicated.k[0].dtype == torch.bfloat16
    per_page = 2 * 3 * 16 * 1 * 16 * 4  # k and v, 3 layers, 16 tokens, 1 local KV head of 16, fp32
    assert KVCache.bytes_per_page(cfg, 2, 16, torch.float32) == per_page
    assert KVCache.pages_for_budget(cfg, 2, 16, 10 * per_page + per_page - 1, torch.float32) == 10
    assert KVCache.pages_for_budget(cfg, 1, 16, 10 * per_page, torch.float32) == 5  # 2 heads at TP 1
    with pytest.raises(ValueError, match="at least one page"):
        KVCache.create(cfg, 1, 0, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="page_size must be positive"):
        KVCache.pages_for_budget(cfg, 1, 0, 1 << 20, torch.float32)
    with pytest.raises(TPConfigError):
        KVCache.create(cfg, 3, 4, 16, torch.float32, "cpu")
