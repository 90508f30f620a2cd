"""Gemma 3's text decoder, one tensor-parallel shard of it per rank, built from the Llama pieces.

What differs from Llama, and why each is here rather than a switch in llama.py: every norm is
x / rms(x) * (1 + w) in fp32 (`OffsetRMSNorm`); each layer normalises attention's and the MLP's outputs
too (four norms); q and k heads are normalised before RoPE; the MLP is GeGLU; embeddings are multiplied by
sqrt(hidden_size) in the model's dtype; logits may be soft-capped. The attention scale
(query_pre_attn_scalar), the RoPE per layer kind and the sliding windows come from ModelConfig, which the
shared attention and model already read.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep.model.attention import AttentionBatch
from lockstep.model.config import ModelConfig
from lockstep.model.layers import OffsetRMSNorm
from lockstep.model.llama import MLP, Attention, LlamaModel
from lockstep.parallel.comm import Comm


class Gemma3DecoderLayer(nn.Module):
    """Pre- and post-norms around attention and around the MLP; residuals add the post-normed outputs."""

    def __init__(self, config: ModelConfig, comm: Comm, layer: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = Attention(config, comm, layer, qk_norm=OffsetRMSNorm)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = MLP(config, comm)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache)
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(LlamaModel):
    """This rank's shard of a Gemma 3 text decoder; the forward and its interface are LlamaModel's."""

    layer_class = Gemma3DecoderLayer
    norm_class = OffsetRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden_size), the factor rounded to the model's dtype first as transformers
        does (in bf16 that is 25.25 for a hidden size of 640, not 25.30)."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype, device=x.device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, soft-capped to (-cap, cap) by cap * tanh(logits / cap) in the model's dtype when set."""
        y = self.lm_head(x)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            y = torch.tanh(y / cap) * cap
        return y.float()
