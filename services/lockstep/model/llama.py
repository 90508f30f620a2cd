"""The Llama-family decoder (Llama, Qwen2, Mistral), one tensor-parallel shard of it per rank.

Attention is split by heads and the MLP by its width (Megatron style): one all-reduce after the
attention output projection, one after the MLP down projection, one in the embedding and one all-gather
of the logits, so every rank ends a forward with the same full-vocab logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.model.attention import AttentionBatch, paged_attention, write_kv
from lockstep.model.config import ModelConfig
from lockstep.model.kv_cache import KVCache
from lockstep.model.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rope,
)
from lockstep.parallel.comm import Comm
from lockstep.parallel.sharding import check_tp_size, kv_head_start, local_heads, local_kv_heads, shard


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, comm: Comm, layer: int) -> None:
        super().__init__()
        tp, rank, d = comm.world_size, comm.rank, config.head_dim
        self.num_heads = local_heads(config, tp)
        self.num_kv_heads = local_kv_heads(config, tp)
        self.head_dim = d
        self.scale = d**-0.5
        self.window = config.window(layer)
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
        qk = apply_rope(qkv[:, :qk_width].view(t, qk_heads, self.head_dim), cos, sin)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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
    """This rank's shard of the decoder; parameters are left uninitialised for the loader to fill."""

    def __init__(self, config: ModelConfig, comm: Comm) -> None:
        super().__init__()
        check_tp_size(config, comm.world_size)
        self.config = config
        self.comm = comm
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm)
        self.layers = nn.ModuleList(DecoderLayer(config, comm, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, comm, tied=tied)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: AttentionBatch,
        kv: KVCache,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run the batch's new tokens, writing their k/v; fp32 logits of each sequence's last token."""
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
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        for layer, k_cache, v_cache in zip(self.layers, kv.k, kv.v, strict=True):
            x = layer(x, cos, sin, batch, k_cache, v_cache)
        if not all_logits:
            x = x[batch.last_token_indices]
        return self.lm_head(self.norm(x)).float()
