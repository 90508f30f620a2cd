"""What the docs owe the user: every environment variable the services and the operator read is named there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def read_variables() -> set[str]:
    """LOCKSTEP_* names the code reads (as string literals), in the services and the operator."""
    names: set[str] = set()
    for tree in ("services/lockstep", "operator/lockstep_operator"):
        for path in (ROOT / tree).rglob("*.py"):
            if "proto_gen" not in path.parts:
                names |= set(re.findall(r"""["'](LOCKSTEP_[A-Z0-9_]+)["']""", path.read_text()))
    return names


def test_every_environment_variable_read_is_documented() -> None:
    docs = "\n".join(p.read_text() for p in DOCS)
    names = read_variables()
    assert "LOCKSTEP_DEVICE" in names and "LOCKSTEP_OPERATOR_API_KEY" in names  # the scan finds what it must
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", docs))
    assert not missing, f"read by the code but named in no doc: {missing}"
