"""Lockstep: tensor-parallel LLM serving whose ranks agree on every decision."""

__version__ = "0.1.0"
