"""A checkpoint of a real model's shape with random weights: for a machine that cannot fetch the real ones.

    python scripts/random_checkpoint.py --like DIR --out DIR [--seed 0] [--layers N]

`--like` is a checkpoint directory, or just its config.json and tokenizer files (what `scripts/gpu_check.sh
prepare` copies of the built-in model); `--out` gets that config, those tokenizer files and random weights
as model.safetensors. Speed is the real model's (same shapes, same kernels); the tokens are not, so it is for
throughput and for parity with `transformers` on the same weights, never for quality.

The weights are drawn wider than transformers' init (which gives near-uniform logits): linear layers at
1.5 / sqrt(fan_in), embeddings at 1, norms around 1. Greedy decoding then has a clear winner at almost every
step, so two correct implementations agree token for token instead of flipping on near-ties.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(1.5 / math.sqrt(p.shape[-1]) * torch.randn(p.shape, generator=gen))


def make(like: Path, out: Path, seed: int = 0, layers: int = 0) -> Path:
    """Write the random checkpoint into `out` and return it; `layers` > 0 keeps only that many layers."""
    config = AutoConfig.from_pretrained(like)
    if layers > 0:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (like / name).is_file():
            shutil.copy(like / name, out / name)
    if not (out / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{like} has no tokenizer.json to copy; the server needs one")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", type=Path, required=True, help="a checkpoint directory, or its config and tokenizer")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=0, help="keep only this many layers (0: all)")
    args = p.parse_args(argv)
    if not (args.like / "config.json").is_file():
        p.error(f"--like {args.like}: no config.json there")
    out = make(args.like, args.out, args.seed, args.layers)
    print(f"random checkpoint of {args.like.name}'s shape in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
