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


def test_the_readme_says_when_lockstep_serve_gives_a_group_up_as_the_supervisor_does() -> None:
    """Bug fix: the README said a group was given up once it 'died 5 times within 30 s of its start'; the supervisor
    counts deaths in a row before the group ever served, whenever they come, with growing pauses between."""
    import inspect

    from lockstep.local_ranks import LocalRanks

    params = inspect.signature(LocalRanks.__init__).parameters
    deaths, pause = params["max_quick_failures"].default, params["pause_s"].default
    pauses = [f"{min(30.0, pause * 2 ** q):g}" for q in range(1, deaths)]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"died {deaths} times in a row before it ever served, after pauses of {', '.join(pauses[:-1])} and "
            f"{pauses[-1]} s") in readme
