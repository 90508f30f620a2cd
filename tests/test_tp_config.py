"""Configurations and TP sizes the model cannot serve are refused before any weight is read, with a
message that names the problem; checkpoints that do not match their config name the tensor."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import lockstep.model.checkpoint_files as checkpoint_files
from lockstep.model.config import ModelConfig, UnsupportedModelError
from lockstep.model.llama import LlamaModel
from lockstep.model.loader import CheckpointError, load_model
from lockstep.parallel.comm import Comm, single_comm
from lockstep.parallel.sharding import TPConfigError, check_tp_size, kv_head_start, valid_tp_sizes

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 384}
SMOLLM2 = {**BASE, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152}


def cfg(**changes) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, **changes})


def test_builtin_model_shape_allows_tp_1_and_3():
    config = ModelConfig.from_hf(SMOLLM2)
    assert valid_tp_sizes(config) == [1, 3]
    check_tp_size(config, 3)
    with pytest.raises(TPConfigError, match=r"does not divide the attention heads \(9\).*work: 1, 3$"):
        check_tp_size(config, 2)


@pytest.mark.parametrize(("changes", "tp", "named"), [
    ({}, 3, "the attention heads (4)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, 2, "the KV heads (3"),
    ({"intermediate_size": 130}, 4, "the MLP width (130)"),
    ({"vocab_size": 385}, 2, "the vocabulary (385)"),
])
def test_tp_size_that_does_not_divide_is_named(changes, tp, named):
    with pytest.raises(TPConfigError) as e:
        check_tp_size(cfg(**changes), tp)
    assert named in str(e.value)
    assert "TP sizes that work: 1" in str(e.value)


def test_kv_heads_replicate_when_tp_is_a_multiple_of_them():
    config = cfg()
    check_tp_size(config, 4)
    assert [kv_head_start(config, r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [kv_head_start(config, r, 2) for r in range(2)] == [0, 1]
    for bad in (0, -1, 8):
        with pytest.raises(TPConfigError):
            check_tp_size(config, bad)


def test_model_refuses_a_tp_size_before_building():
    with pytest.raises(TPConfigError, match="tensor-parallel size 3"):
        LlamaModel(cfg(), Comm(0, 3))


@pytest.mark.parametrize(("changes", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]},
     "architecture GPT2LMHeadModel is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM, "
     "MistralForCausalLM"),
    ({"architectures": None, "model_type": "gemma"}, "architecture model_type='gemma' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads (3)"),
    ({"num_hidden_layers": None}, "config.json has no 'num_hidden_layers'"),
    ({"num_hidden_layers": "thirty"}, "config.json's 'num_hidden_layers' must be an integer, not 'thirty'"),
    ({"num_hidden_layers": 2.5}, "config.json's 'num_hidden_layers' must be an integer, not 2.5"),
    ({"eos_token_id": "</s>"}, "config.json's 'eos_token_id' must be a token id or a list of them, not '</s>'"),
    ({"eos_token_id": [2, -1]}, "config.json's 'eos_token_id' must be a token id or a list of them, not [2, -1]"),
    ({"bos_token_id": "<s>"}, "config.json's 'bos_token_id' must be a token id, not '<s>'"),
    ({"num_attention_heads": 0}, "num_heads must be positive, got 0"),
    ({"num_key_value_heads": 0}, "num_kv_heads must be positive, got 0"),
    ({"head_dim": 0}, "head_dim must be positive, got 0"),
    ({"rope_theta": 0}, "rope_theta must be positive and finite, got 0.0"),
    ({"rope_theta": float("nan")}, "rope_theta must be positive and finite, got nan"),
    ({"rope_theta": "x"}, "config.json's 'rope_theta' must be a number, not 'x'"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be at least 0 and finite, got -1.0"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be at least 0 and finite, got inf"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}},
     "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got 4.0 and 4.0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 0}},
     "original_max_position_embeddings must be positive, got 0"),
])
def test_unsupported_configs_are_refused(changes, message):
    d = {**BASE, **changes}
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf(d)
    assert message in str(e.value)


def test_family_switches_are_read():
    llama = cfg(attention_bias=True, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0},
                sliding_window=16)
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, False)
    assert llama.rope_theta == 5e5 and llama.rope_scaling.rope_type == "linear"
    assert llama.rope_scaling.factor == 2.0
    assert llama.window(0) is None  # Llama has no sliding window, whatever the config says
    qwen = cfg(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=False,
               tie_word_embeddings=True)
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert qwen.sliding_window is None and qwen.layer_types == ("full_attention",) * 2
    hybrid = cfg(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True,
                 layer_types=["sliding_attention", "full_attention"])
    assert [hybrid.window(i) for i in range(2)] == [16, None]
    mistral = cfg(architectures=["MistralForCausalLM"], sliding_window=16, head_dim=32)
    assert [mistral.window(i) for i in range(2)] == [16, 16] and mistral.head_dim == 32
    l3 = cfg(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert l3.rope_scaling.rope_type == "llama3" and l3.rope_scaling.original_max_position_embeddings == 8192
    with pytest.raises(UnsupportedModelError, match="layer_types has 3 entries for 2 layers"):
        cfg(architectures=["Qwen2ForCausalLM"], layer_types=["full_attention"] * 3)


def test_from_dir_merges_generation_config_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2, "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = ModelConfig.from_dir(tmp_path)
    assert config.eos_token_ids == (2, 7) and config.bos_token_id == 1
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(UnsupportedModelError, match="generation_config.json's 'eos_token_id' must be a token id"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_dir(tmp_path / "missing")


@pytest.fixture
def qwen_copy(checkpoint_dir, tmp_path):
    src = checkpoint_dir("qwen2_bias_tied")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(qwen_copy):
    tensors = load_file(qwen_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, qwen_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no tensor 'model.layers.1.self_attn.k_proj.bias' \(expected "
                                              r"shape \[32\]\)"):
        load_model(qwen_copy, single_comm(), "cpu")


def test_wrong_shape_is_named(qwen_copy):
    tensors = load_file(qwen_copy / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(120, 64)
    save_file(tensors, qwen_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' in model.safetensors has "
                                              r"shape \[120, 64\], .* needs \[128, 64\]"):
        load_model(qwen_copy, single_comm(), "cpu")


def test_untied_checkpoint_without_lm_head_is_refused(qwen_copy):
    config = json.loads((qwen_copy / "config.json").read_text())
    (qwen_copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(CheckpointError, match="no tensor 'lm_head.weight'"):
        load_model(qwen_copy, single_comm(), "cpu")


@pytest.mark.parametrize(("extra", "why"), [
    ("model.layers.2.mlp.up_proj.weight", "a layer past num_hidden_layers"),
    ("model.layers.0.self_attn.o_proj.bias", "a bias the config does not give the model"),
    ("model.layers.1.mlp.experts.0.up_proj.weight", "a tensor of another architecture"),
])
def test_a_tensor_the_model_would_not_read_is_refused_by_name(qwen_copy, extra, why):
    """Silently skipping it would serve another model than the checkpoint's (its biases or layers dropped)."""
    tensors = load_file(qwen_copy / "model.safetensors")
    tensors[extra] = torch.zeros(4)
    save_file(tensors, qwen_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"1 tensor .*does not use: '{re.escape(extra)}'"):
        load_model(qwen_copy, single_comm(), "cpu")


def test_tensors_transformers_also_skips_are_not_refused(qwen_copy):
    """Old Llama checkpoints' rotary buffers, and an LM head saved beside tied embeddings, are not weights."""
    tensors = load_file(qwen_copy / "model.safetensors")
    want = load_model(qwen_copy, single_comm(), "cpu").state_dict()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, qwen_copy / "model.safetensors", metadata={"format": "pt"})
    got = load_model(qwen_copy, single_comm(), "cpu").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def test_a_tensor_in_two_files_is_refused(checkpoint_dir, tmp_path):
    """Without an index, which copy a rank read would depend on the order it listed the files in."""
    src = checkpoint_dir("llama_gqa")
    shutil.copytree(src, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors.index.json").unlink()
    files = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    first = load_file(files[0])
    name = sorted(first)[0]
    extra = {name: first[name] + 1}
    save_file(extra, tmp_path / "ckpt" / "zz-extra.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{re.escape(repr(name))} is in both {files[0].name} and zz-extra"):
        checkpoint_files.check_checkpoint(tmp_path / "ckpt")


def test_a_rank_reads_only_its_slices(checkpoint_dir, monkeypatch):
    """Rank 1 of 2 loads exactly its rows/columns (read through get_slice, never a whole sharded tensor)."""
    path = checkpoint_dir("llama_gqa")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    reads: list[tuple[str, object]] = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            handle = self.inner.__enter__()

            class Handle:
                def keys(self):
                    return handle.keys()

                def get_slice(self, name):
                    sl = handle.get_slice(name)

                    class Slice:
                        def get_shape(self):
                            return sl.get_shape()

                        def get_dtype(self):
                            return sl.get_dtype()

                        def __getitem__(self, key):
                            reads.append((name, key))
                            return sl[key]

                    return Slice()

                def get_tensor(self, name):
                    raise AssertionError(f"{name} read whole")

            return Handle()

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(checkpoint_files, "safe_open", lambda *a, **k: Recording(safe_open(*a, **k)))
    model = load_model(path, Comm(1, 2), "cpu")
    by_name = dict(reads)
    assert by_name["model.layers.0.self_attn.q_proj.weight"] == slice(32, 64)
    assert by_name["model.layers.0.self_attn.k_proj.weight"] == slice(16, 32)
    assert by_name["model.layers.1.mlp.down_proj.weight"] == (slice(None), slice(64, 128))
    assert by_name["lm_head.weight"] == slice(192, 384)

    full = {}
    for f in path.glob("*.safetensors"):
        full.update(load_file(f))
    attn = model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split(attn.qkv_proj.split_sizes())
    assert torch.equal(q, full["model.layers.1.self_attn.q_proj.weight"][32:64])
    assert torch.equal(v, full["model.layers.1.self_attn.v_proj.weight"][16:32])
    assert torch.equal(attn.o_proj.weight, full["model.layers.1.self_attn.o_proj.weight"][:, 32:64])
    assert torch.equal(model.embed_tokens.weight, full["model.embed_tokens.weight"][192:])


def test_sharded_checkpoint_loads_without_its_index(checkpoint_dir, tmp_path):
    src = checkpoint_dir("llama_gqa")
    dst = tmp_path / "no_index"
    shutil.copytree(src, dst)
    (dst / "model.safetensors.index.json").unlink()
    a = load_model(src, single_comm(), "cpu").state_dict()
    b = load_model(dst, single_comm(), "cpu").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_device_and_backend_choice(monkeypatch):
    from lockstep.device import dist_backend, pick_device
    from lockstep.parallel.comm import parse_rendezvous

    monkeypatch.setenv("LOCKSTEP_DEVICE", "cpu")
    assert pick_device(3) == torch.device("cpu")
    assert dist_backend(pick_device()) == "gloo" and dist_backend("cuda:1") == "nccl"
    monkeypatch.setenv("LOCKSTEP_DEVICE", "tpu")
    with pytest.raises(ValueError, match="LOCKSTEP_DEVICE='tpu'"):
        pick_device()
    if not torch.cuda.is_available():
        monkeypatch.setenv("LOCKSTEP_DEVICE", "cuda")
        with pytest.raises(ValueError, match="CUDA is not available"):
            pick_device()
    assert parse_rendezvous("rank-0.g0:29500") == ("rank-0.g0", 29500)
    assert parse_rendezvous("[::1]:29500") == ("::1", 29500)
    for bad in ("localhost", "host:", "host:99999", ":29500"):
        with pytest.raises(ValueError, match="is not 'host:port'"):
            parse_rendezvous(bad)
    with pytest.raises(ValueError, match="rank 2 is not in a group of world size 2"):
        Comm(2, 2)


@pytest.mark.parametrize("device, words", [("foo", "LOCKSTEP_DEVICE='foo' is not a device"),
                                           ("cuda:0" if not torch.cuda.is_available() else "tpu",
                                            "CUDA is not available" if not torch.cuda.is_available()
                                            else "only 'cpu' and 'cuda'")])
def test_a_rank_given_a_device_it_cannot_use_stops_with_one_line_saying_so(tiny_llama, device, words):
    """docs/commands.md: a LOCKSTEP_DEVICE that is not a device, or `cuda` on a machine without one, "stops the rank
    at start-up with one line saying so". It stopped with two chained tracebacks (about 30 lines) under
    `the engine did not start`."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lockstep.cli", "rank", "--rank", "0", "--host", "127.0.0.1",
                          "--port", "0", "--model", str(tiny_llama), "--threads", "1", "--kv-pages", "8"],
                         env={**os.environ, "LOCKSTEP_DEVICE": device}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and words in errors[0], out.stderr
