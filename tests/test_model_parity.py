"""The model matches transformers on the same checkpoint, at TP 1 and TP 2, prefill and paged decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import KINDS, TEXT
from distributed import ProcessGroup
from lockstep.model.attention import AttentionBatch
from lockstep.model.kv_cache import KVCache
from lockstep.model.loader import load_model
from lockstep.parallel.comm import Comm, single_comm

PROMPT_LEN = 20
DECODE_STEPS = 32
PAGE_SIZE = 4
TOL = 1e-4


@pytest.fixture(scope="module")
def group():
    g = ProcessGroup(2)
    yield g
    g.close()


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    """kind -> (path, tokens, logits): the prompt and HF's 32 greedy tokens, HF's logits at every step."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(kind: str) -> tuple[Path, torch.Tensor, torch.Tensor]:
        path = checkpoint_dir(kind)
        if kind not in made:
            prompt = Tokenizer.from_file(str(path / "tokenizer.json")).encode(TEXT).ids[:PROMPT_LEN]
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
            hf.eval()
            tokens = torch.tensor(prompt)
            with torch.no_grad():
                for _ in range(DECODE_STEPS):
                    nxt = hf(tokens.unsqueeze(0)).logits[0, -1].argmax()
                    tokens = torch.cat([tokens, nxt.view(1)])
                logits = hf(tokens.unsqueeze(0)).logits[0, PROMPT_LEN - 1:]
            assert torch.equal(logits[:-1].argmax(-1), tokens[PROMPT_LEN:])
            made[kind] = (tokens, logits)
        return (path, *made[kind])

    return get


def prefill_then_decode(comm: Comm, path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill the prompt, then decode the given tokens one at a time through scattered pages."""
    torch.manual_seed(0)
    model = load_model(path, comm, "cpu")
    kv = KVCache.create(model.config, comm.world_size, 32, PAGE_SIZE, torch.float32, "cpu")
    table = torch.randperm(32)[: -(-len(tokens) // PAGE_SIZE)].tolist()
    rows = [model(tokens[:PROMPT_LEN], AttentionBatch.build([(0, PROMPT_LEN, table)], PAGE_SIZE), kv)]
    for pos in range(PROMPT_LEN, len(tokens)):
        batch = AttentionBatch.build([(pos, 1, table)], PAGE_SIZE)
        rows.append(model(tokens[pos: pos + 1], batch, kv))
    return torch.cat(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_tp1_matches_transformers(kind, reference):
    path, tokens, ref = reference(kind)
    ours = prefill_then_decode(single_comm(), path, tokens)
    assert ours.shape == ref.shape == (DECODE_STEPS + 1, 384)
    assert (ours - ref).abs().max().item() < TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "llama_tp3"])  # 3 KV heads do not split two ways
def test_tp2_matches_transformers_on_every_rank(kind, reference, group):
    path, tokens, ref = reference(kind)
    rank0, rank1 = group.run(prefill_then_decode, path, tokens)
    assert torch.equal(rank0, rank1), "ranks ended a forward with different logits"
    assert (rank0 - ref).abs().max().item() < TOL
    assert torch.equal(rank0.argmax(-1), ref.argmax(-1))


def test_tp3_matches_transformers_on_every_rank(reference):
    """Three ranks, one KV head each: the size `lockstep serve` splits the built-in model into on a small machine."""
    path, tokens, ref = reference("llama_tp3")
    g = ProcessGroup(3)
    try:
        outs = g.run(prefill_then_decode, path, tokens)
    finally:
        g.close()
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "ranks ended a forward with different logits"
    assert (outs[0] - ref).abs().max().item() < TOL
    assert torch.equal(outs[0].argmax(-1), ref.argmax(-1))


def test_sliding_window_is_what_makes_the_sliding_model_match(reference):
    """Without its window the sliding model drifts from transformers once the sequence outgrows it,
    so the parity above really exercises the window."""
    path, tokens, ref = reference("sliding")
    model = load_model(path, single_comm(), "cpu")
    windows = [layer.self_attn.window for layer in model.layers]
    assert windows == [8, None, 8]
    for layer in model.layers:
        layer.self_attn.window = None
    kv = KVCache.create(model.config, 1, 16, PAGE_SIZE, torch.float32, "cpu")
    batch = AttentionBatch.build([(0, len(tokens), list(range(13)))], PAGE_SIZE)
    full = model(tokens, batch, kv, all_logits=True)[PROMPT_LEN - 1:]
    assert (full[:1] - ref[:1]).abs().max().item() > 1e-2
