"""Shared fixtures: tiny checkpoints made once per session, and the leak check after every load."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: kind -> a tiny random Hugging Face checkpoint directory (made once per kind)."""
    from checkpoints import make_checkpoint

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_llama(checkpoint_dir) -> Path:
    return checkpoint_dir("llama_gqa")


@pytest.fixture
def no_leak(group):
    """After a test's load on the module's `group` (a Cluster): no page held, no step ever refused by a rank."""
    yield
    group.assert_clean()
