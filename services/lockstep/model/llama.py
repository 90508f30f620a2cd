"""The Llama-family decoder (Llama, Qwen2, Mistral), one tensor-parallel shard of it per rank.

Attention is split by heads and the MLP by its width (Megatron style): one all-reduce after the
attention output projection, one after the MLP down projection, one in the embedding and one all-gather
of the logits, so every rank ends a forward with the same full-vocab logits. Gemma 3 (model/gemma3.py)
reuses these pieces: attention with q/k norms, the MLP with its activation, the model with its hooks.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep.model.attention import AttentionBatch, PoolBatches, batch_of, paged_attention, write_kv
from lockstep.model.config import ModelConfig
from lockstep.model.kv_cache import KVCache
from lockstep.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    activation,
    apply_rope,
)
from lockstep.parallel.comm import Comm
from lockstep.parallel.sharding import check_tp_size, kv_head_start, local_heads, local_kv_heads, shard


class Attention(nn.Module):
    """This rank's heads of one attention layer; `qk_norm`, when given, is the norm class that normalises each
    q and k head before RoPE (Gemma 3's q_norm / k_norm, replicated on every rank)."""

    def __init__(self, config: ModelConfig, comm: Comm, layer: int, qk_norm: type[RMSNorm] | None = None) -> None:
        super().__init__()
        tp, rank, d = comm.world_size, comm.rank, config.head_dim
        self.num_heads = local_heads(config, tp)
        self.num_kv_heads = local_kv_heads(config, tp)
        self.head_dim = d
        self.scale = config.attention_scale
        self.window = config.window(layer)
        self.q_norm = qk_norm(d, config.rms_norm_eps) if qk_norm is not None else None
        self.k_norm = qk_norm(d, config.rms_norm_eps) if qk_norm is not None else None
        q_total, kv_total = config.num_heads * d, config.num_kv_heads * d
        q_start, q_len = shard(q_total, rank, tp)
        kv_start, kv_len = kv_head_start(config, rank, tp) * d, self.num_kv_heads * d
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [(q_total, q_start, q_len), (kv_total, kv_start, kv_len), (kv_total, kv_start, kv_len)],
            bias=config.qkv_bias,
        )
        self.o_proj = RowParallelLinear(q_total, config.hidden_size, config.o_bias, comm)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k sit side by side in each row, so one RoPE call rotates both heads' groups.
        qk_heads = self.num_heads + self.num_kv_heads
        qk_width = qk_heads * self.head_dim
        qk = qkv[:, :qk_width].view(t, qk_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_width:].view(t, self.num_kv_heads, self.head_dim)
        write_kv(k, v, k_cache, v_cache, batch)
        o = paged_attention(q, k_cache, v_cache, batch, self.window, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, comm: Comm) -> None:
        super().__init__()
        width = config.intermediate_size
        start, length = shard(width, comm.rank, comm.world_size)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [(width, start, length), (width, start, length)], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(width, config.hidden_size, config.mlp_bias, comm)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, comm: Comm, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, comm, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, comm)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """This rank's shard of the decoder; parameters are left uninitialised for the loader to fill.

    A family that differs in its layers, its final norm, its embedding or its logits (Gemma 3) subclasses
    this and sets `layer_class` / `norm_class` or overrides `embed` / `logits`; the forward stays one.
    """

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, config: ModelConfig, comm: Comm) -> None:
        super().__init__()
        check_tp_size(config, comm.world_size)
        self.config = config
        self.comm = comm
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm)
        self.layers = nn.ModuleList(self.layer_class(config, comm, i) for i in range(config.num_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        # One RotaryEmbedding per distinct (theta, scaling): Gemma 3's sliding and full layers differ.
        ropes = [config.rope_of(i) for i in range(config.num_layers)]
        distinct = list(dict.fromkeys(ropes))
        self.rotaries = nn.ModuleList(RotaryEmbedding(config.head_dim, *rope) for rope in distinct)
        self.rope_index = tuple(distinct.index(rope) for rope in ropes)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, comm, tied=tied)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batches: PoolBatches,
        kv: KVCache,
        all_logits: bool = False,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the batch's new tokens, writing their k/v; fp32 logits of each sequence's last token (of every
        token with `all_logits`; of the flat positions `rows` when given: a vocabulary-wide row costs memory).

        Each layer reads the batch of its KV pool (`batches[config.pool_of(layer)]`); the pools' batches
        differ only in their page tables.
        """
        config = self.config
        batch = batch_of(batches, config.pool_of(0))
        if input_ids.dim() != 1 or input_ids.shape[0] != batch.num_tokens:
            raise ValueError(
                f"input_ids has shape {tuple(input_ids.shape)} but the batch has {batch.num_tokens} tokens")
        if kv.num_layers != self.config.num_layers or kv.page_size != batch.page_size:
            raise ValueError(
                f"KV cache of {kv.num_layers} layers and page size {kv.page_size} does not fit a model of "
                f"{self.config.num_layers} layers and a batch of page size {batch.page_size}")
        attn = self.layers[0].self_attn
        if kv.kv_heads != attn.num_kv_heads or kv.head_dim != attn.head_dim:
            raise ValueError(
                f"KV cache holds {kv.kv_heads} heads of {kv.head_dim}, this shard needs "
                f"{attn.num_kv_heads} of {attn.head_dim}")
        x = self.embed(input_ids)
        rope = [rotary(batch.positions, x.dtype) for rotary in self.rotaries]
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, kv.k, kv.v, strict=True)):
            cos, sin = rope[self.rope_index[i]]
            x = layer(x, cos, sin, batch_of(batches, config.pool_of(i)), k_cache, v_cache)
        if rows is not None:
            x = x[rows]
        elif not all_logits:
            x = x[batch.last_token_indices]
        return self.logits(self.norm(x))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of the input tokens (a hook: Gemma scales them)."""
        return self.embed_tokens(input_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 full-vocab logits of normed hidden states (a hook: Gemma may soft-cap them)."""
        return self.lm_head(x).float()
