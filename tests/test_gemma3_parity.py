"""Gemma 3 matches transformers on the same checkpoint, at TP 1 and TP 2, over prompts several windows long.

The tiny checkpoints (tests/checkpoints.py, GEMMA3_KINDS) have sliding window 8 with pages of 4 or 8
tokens, so the 40-token prompt is five windows and the 32 decoded tokens four more; sliding layers read
their own pool, whose pages before the window are replaced by a page of NaNs once decoding starts, as the
engine reuses them. The ablation test shows each Gemma feature is one the parity depends on.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from checkpoints import GEMMA3_KINDS, TEXT
from distributed import ProcessGroup
from lockstep.model.attention import AttentionBatch
from lockstep.model.config import ModelConfig, RopeScaling, UnsupportedModelError
from lockstep.model.gemma3 import Gemma3Model
from lockstep.model.kv_cache import KVCache
from lockstep.model.llama import LlamaModel
from lockstep.model.loader import load_model
from lockstep.parallel.comm import Comm, single_comm

PROMPT_LEN = 40
DECODE_STEPS = 32
WINDOW = 8
TOL = 1e-4


@pytest.fixture(scope="module")
def group():
    g = ProcessGroup(2)
    yield g
    g.close()


@pytest.fixture(scope="module")
def gemma3_dir(checkpoint_dir):
    return checkpoint_dir


@pytest.fixture(scope="module")
def reference(gemma3_dir):
    """kind -> (path, tokens, logits): the prompt and transformers' 32 greedy tokens, its logits at every
    position (row i: the logits after token i)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(kind: str) -> tuple[Path, torch.Tensor, torch.Tensor]:
        path = gemma3_dir(kind)
        if kind not in made:
            prompt = Tokenizer.from_file(str(path / "tokenizer.json")).encode(TEXT).ids[:PROMPT_LEN]
            assert len(prompt) == PROMPT_LEN
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
            hf.eval()
            tokens = torch.tensor(prompt)
            with torch.no_grad():
                for _ in range(DECODE_STEPS):
                    nxt = hf(tokens.unsqueeze(0)).logits[0, -1].argmax()
                    tokens = torch.cat([tokens, nxt.view(1)])
                logits = hf(tokens.unsqueeze(0)).logits[0]
            assert torch.equal(logits[PROMPT_LEN - 1:-1].argmax(-1), tokens[PROMPT_LEN:])
            made[kind] = (tokens, logits)
        return (path, *made[kind])

    return get


def _kv_with_poison(config: ModelConfig, tp: int, pages: int, page_size: int) -> tuple[KVCache, int]:
    """A cache with `pages` + 1 pages per pool, the last page of the sliding pool filled with NaN."""
    kv = KVCache.create(config, tp, pages + 1, page_size, torch.float32, "cpu")
    for i in range(config.num_layers):
        if config.pool_of(i) == "sliding":
            kv.k[i][pages] = float("nan")
            kv.v[i][pages] = float("nan")
    return kv, pages


def _pool_batches(config: ModelConfig, spans: list[tuple[int, int, dict[str, list[int]]]], page_size: int,
                  poison: int | None = None) -> dict[str, AttentionBatch]:
    """One AttentionBatch per pool; with `poison`, a sliding table's pages wholly before every query's window
    point at the NaN page, as a released page that another request now fills."""
    out = {}
    for pool in config.pool_names:
        pool_spans = []
        for start, n, tables in spans:
            table = tables[pool]
            if pool == "sliding" and poison is not None:
                lo = max(0, start + 1 - config.sliding_window)
                table = [poison if (p + 1) * page_size <= lo else page for p, page in enumerate(table)]
            pool_spans.append((start, n, table))
        out[pool] = AttentionBatch.build(pool_spans, page_size)
    return out


def prefill_then_decode(comm: Comm, path: Path, tokens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Prefill the prompt in one chunk, then decode the given tokens one at a time; each pool has its own
    scattered page table, and decode steps see NaN in the sliding pool's pages outside the window."""
    torch.manual_seed(0)
    model = load_model(path, comm, "cpu")
    config = model.config
    n_pages = -(-len(tokens) // page_size)
    kv, poison = _kv_with_poison(config, comm.world_size, n_pages + 4, page_size)
    tables = {pool: torch.randperm(n_pages + 4)[:n_pages].tolist() for pool in config.pool_names}
    rows = [model(tokens[:PROMPT_LEN], _pool_batches(config, [(0, PROMPT_LEN, tables)], page_size), kv)]
    for pos in range(PROMPT_LEN, len(tokens)):
        rows.append(model(tokens[pos: pos + 1], _pool_batches(config, [(pos, 1, tables)], page_size, poison), kv))
    return torch.cat(rows)


def chunked(model: LlamaModel, sequences: list[tuple[torch.Tensor, int]], page_size: int) -> list[torch.Tensor]:
    """Run every (tokens, chunk size) sequence in the same steps, each step one mixed batch of every unfinished
    sequence's next chunk (its sliding pages before the chunk's window poisoned); every position's logits."""
    config = model.config
    need = [-(-len(t) // page_size) for t, _ in sequences]
    kv, poison = _kv_with_poison(config, 1, sum(need), page_size)
    perm = {pool: torch.randperm(sum(need)).tolist() for pool in config.pool_names}
    firsts = [sum(need[:i]) for i in range(len(sequences))]
    tables = [{pool: perm[pool][f: f + n] for pool in perm} for f, n in zip(firsts, need, strict=True)]
    done = [0] * len(sequences)
    out: list[list[torch.Tensor]] = [[] for _ in sequences]
    while any(d < len(t) for d, (t, _) in zip(done, sequences, strict=True)):
        live = [i for i, (t, _) in enumerate(sequences) if done[i] < len(t)]
        spans = [(done[i], min(sequences[i][1], len(sequences[i][0]) - done[i]), tables[i]) for i in live]
        ids = torch.cat([sequences[i][0][s: s + n] for i, (s, n, _) in zip(live, spans, strict=True)])
        logits = model(ids, _pool_batches(config, spans, page_size, poison), kv, all_logits=True)
        for i, part in zip(live, logits.split([n for _, n, _ in spans]), strict=True):
            out[i].append(part)
            done[i] += part.shape[0]
    return [torch.cat(rows) for rows in out]


@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("kind", GEMMA3_KINDS)
def test_tp1_matches_transformers(kind, page_size, reference):
    path, tokens, ref = reference(kind)
    ours = prefill_then_decode(single_comm(), path, tokens, page_size)
    want = ref[PROMPT_LEN - 1:]
    assert ours.shape == want.shape == (DECODE_STEPS + 1, 384)
    assert (ours - want).abs().max().item() < TOL
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", GEMMA3_KINDS)
def test_tp2_matches_transformers_on_every_rank(kind, reference, group):
    path, tokens, ref = reference(kind)
    rank0, rank1 = group.run(prefill_then_decode, path, tokens, 4)
    assert torch.equal(rank0, rank1), "ranks ended a forward with different logits"
    want = ref[PROMPT_LEN - 1:]
    assert (rank0 - want).abs().max().item() < TOL
    assert torch.equal(rank0.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", GEMMA3_KINDS)
def test_chunked_prefill_in_mixed_batches_matches_transformers(kind, reference):
    """Chunks that start mid-page and mid-window, two sequences per batch, every position's logits."""
    path, tokens, ref = reference(kind)
    model = load_model(path, single_comm(), "cpu")
    torch.manual_seed(1)
    a, b = chunked(model, [(tokens, 12), (tokens[:61], 7)], 4)
    assert (a - ref).abs().max().item() < TOL
    assert (b - ref[:61]).abs().max().item() < TOL


def _ablate(model: LlamaModel, what: str) -> None:
    layers = list(model.layers)
    if what == "window":
        for layer in layers:
            layer.self_attn.window = None
    elif what == "sliding_rope":
        full = model.config.layer_types.index("full_attention")
        model.rope_index = (model.rope_index[full],) * len(layers)
    elif what == "qk_norm":
        for layer in layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = None
    elif what == "attention_scale":
        for layer in layers:
            layer.self_attn.scale = layer.self_attn.head_dim**-0.5
    elif what == "embed_scale":
        model.embed = lambda ids: model.embed_tokens(ids)  # a plain function shadows the method
    elif what == "softcap":
        model.config = replace(model.config, final_logit_softcapping=None)
    elif what == "post_norms":
        for layer in layers:
            layer.post_attention_layernorm = layer.post_feedforward_layernorm = torch.nn.Identity()


@pytest.mark.parametrize(("kind", "what"), [
    ("gemma3_hybrid", "window"), ("gemma3_hybrid", "sliding_rope"), ("gemma3_hybrid", "qk_norm"),
    ("gemma3_hybrid", "attention_scale"), ("gemma3_hybrid", "embed_scale"), ("gemma3_hybrid", "post_norms"),
    ("gemma3_legacy", "window"), ("gemma3_legacy", "sliding_rope"), ("gemma3_legacy", "softcap"),
])
def test_each_gemma_feature_is_one_the_parity_needs(kind, what, reference):
    """Without any one of them the model drifts from transformers, so the parity above really tests each."""
    path, tokens, ref = reference(kind)
    model = load_model(path, single_comm(), "cpu")
    assert (chunked(model, [(tokens, 16)], 4)[0] - ref).abs().max().item() < TOL
    _ablate(model, what)
    drift = (chunked(model, [(tokens, 16)], 4)[0] - ref).abs().max().item()
    assert not drift < 1e-2  # NaN too: without its window a layer reads the pages the window let go


def test_embedding_scale_is_rounded_to_the_model_dtype(gemma3_dir):
    """In bf16 transformers multiplies by sqrt(hidden) rounded to bf16 first (25.25, not 25.298, for 640)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    path = gemma3_dir("gemma3_hybrid")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours = load_model(path, single_comm(), "cpu", torch.bfloat16)
    ids = torch.arange(0, 384, 7)
    assert torch.equal(ours.embed(ids), hf.model.embed_tokens(ids.unsqueeze(0))[0])
    # sqrt(64) = 8 is exact in bf16; a hidden size of 640 tells the two roundings apart.
    wide = Gemma3Model(replace(ours.config, hidden_size=640, head_dim=160, num_kv_heads=4), single_comm())
    weight = torch.randn(384, 640, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    wide.embed_tokens.weight.data = weight
    hf_embed = Gemma3TextScaledWordEmbedding(384, 640, None, embed_scale=640**0.5).to(torch.bfloat16)
    hf_embed.weight.data = weight
    assert torch.equal(wide.embed(ids), hf_embed(ids))
    assert not torch.equal(wide.embed(ids), (weight[ids].float() * 640**0.5).to(torch.bfloat16))


# A multimodal Gemma 3 (gemma-3-4b-it's config.json, abridged): its text_config names only what differs
# from Gemma3TextConfig's defaults, so reading it needs those defaults.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
    "boi_token_index": 255999, "image_token_index": 262144, "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
# Gemma 3 270M's config.json as the hub has it (transformers 4.x keys), the shape the GGUF import writes.
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": None,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "intermediate_size": 2048,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "max_position_embeddings": 32768,
    "num_attention_heads": 4, "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": 512, "_sliding_window_pattern": 6, "vocab_size": 262144,
    "use_bidirectional_attention": False,
}


def _hf_text_config(d: dict):
    """transformers' own reading of the same dict: the text config of a multimodal one."""
    from transformers import Gemma3Config, Gemma3TextConfig

    if d.get("model_type") == "gemma3":
        return Gemma3Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")}).text_config
    return Gemma3TextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})


def _scaling(params: dict) -> RopeScaling:
    kind = params["rope_type"]
    return RopeScaling() if kind == "default" else RopeScaling(kind, params["factor"])


@pytest.mark.parametrize("d", [GEMMA3_4B, GEMMA3_270M], ids=["gemma-3-4b", "gemma-3-270m"])
def test_real_configs_are_read_as_transformers_reads_them(d):
    ours, hf = ModelConfig.from_hf(json.loads(json.dumps(d))), _hf_text_config(json.loads(json.dumps(d)))
    assert ours.architecture == "Gemma3ForCausalLM"
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (ours.intermediate_size, ours.vocab_size, ours.rms_norm_eps) == (
        hf.intermediate_size, hf.vocab_size, hf.rms_norm_eps)
    assert ours.layer_types == tuple(hf.layer_types) and ours.sliding_window == hf.sliding_window
    assert ours.attention_scale == hf.query_pre_attn_scalar**-0.5 and ours.tie_word_embeddings
    full = ours.layer_types.index("full_attention")
    sliding = ours.layer_types.index("sliding_attention")
    for layer, kind in ((full, "full_attention"), (sliding, "sliding_attention")):
        params = hf.rope_parameters[kind]
        assert ours.rope_of(layer) == (params["rope_theta"], _scaling(params))
    assert ours.pool_names == ("full", "sliding") and ours.window(full) is None


def test_gemma3_checkpoint_configs_are_read(gemma3_dir):
    hybrid = ModelConfig.from_dir(gemma3_dir("gemma3_hybrid"))
    assert (hybrid.num_kv_heads, hybrid.head_dim, hybrid.hidden_size // hybrid.num_heads) == (1, 32, 16)
    assert hybrid.attention_scale == 24**-0.5 and hybrid.final_logit_softcapping is None
    assert [hybrid.window(i) for i in range(4)] == [8, 8, None, 8]
    assert hybrid.rope_of(0) == (100.0, RopeScaling()) and hybrid.rope_of(2) == (10000.0, RopeScaling("linear", 2.0))
    legacy_json = json.loads((gemma3_dir("gemma3_legacy") / "config.json").read_text())
    assert "rope_parameters" not in legacy_json and "layer_types" not in legacy_json
    legacy = ModelConfig.from_dir(gemma3_dir("gemma3_legacy"))
    assert legacy.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert legacy.rope_of(0) == (50.0, RopeScaling()) and legacy.rope_of(2) == (500.0, RopeScaling("linear", 4.0))
    assert legacy.final_logit_softcapping == 5.0 and legacy.qkv_bias and legacy.o_bias
    assert not legacy.tie_word_embeddings


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_multimodal_checkpoint_loads_its_text_decoder(prefix, gemma3_dir, tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (transformers 5 or 4.x tensor names) serves its text decoder."""
    from safetensors.torch import load_file, save_file

    src = gemma3_dir("gemma3_legacy")
    text = json.loads((src / "config.json").read_text())
    head = "lm_head." if prefix.startswith("model.") else "language_model.lm_head."
    tensors = {(prefix + k.removeprefix("model.")) if k.startswith("model.") else head + k.removeprefix("lm_head."): v
               for k, v in load_file(src / "model.safetensors").items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(4)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "tie_word_embeddings": False, "text_config": text}))
    want, got = load_model(src, single_comm(), "cpu"), load_model(tmp_path, single_comm(), "cpu")
    assert want.config == replace(got.config, name_or_path=want.config.name_or_path)
    assert want.state_dict().keys() == got.state_dict().keys()
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in want.state_dict().items())


@pytest.mark.parametrize(("changes", "message"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "activation 'relu' is not supported; supported: silu, gelu_pytorch_tanh"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters must be keyed by layer kind"),
    ({"layer_types": ["chunked_attention"] * 18}, "layer types ['chunked_attention'] are not supported"),
    ({"sliding_window": None}, "names sliding_attention layers but sliding_window is not set"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be positive"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads (3)"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "has no text_config"),
    ({"architectures": None, "model_type": "gemma2"}, "architecture model_type='gemma2' is not supported"),
])
def test_unsupported_gemma3_configs_are_refused(changes, message):
    d = {k: v for k, v in {**GEMMA3_270M, **changes}.items() if v is not None or k == "sliding_window"}
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf(d)
    assert message in str(e.value)


def test_final_logit_softcapping_is_supported():
    assert ModelConfig.from_hf({**GEMMA3_270M, "final_logit_softcapping": 30.0}).final_logit_softcapping == 30.0
