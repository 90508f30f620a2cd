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


def help_flags(*argv: str) -> set[str]:
    """The flags `lockstep ARGV --help` lists."""
    import contextlib
    import io

    from lockstep.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))


# Flags the docs name that belong to other tools: lm_eval, aiperf, docker, kubectl, vLLM (named for comparison).
OTHER_TOOLS_FLAGS = {"--include_path", "--tasks", "--model_args", "--endpoint-type", "--streaming", "--tokenizer",
                     "--synthetic-input-tokens-mean", "--output-tokens-mean", "--extra-inputs", "--request-count",
                     "--ui", "--target", "--replicas", "--previous", "--overwrite", "--api-server-count"}
USER_DOCS = [ROOT / "README.md", ROOT / "docs/commands.md", ROOT / "docs/runbook.md"]


def test_every_flag_the_docs_name_is_a_flag_of_a_lockstep_command() -> None:
    flags = set().union(*(help_flags(*c) for c in (["rank"], ["serve"], ["coordinator"], ["bench"],
                                                     ["bench", "--control-plane"])))
    assert "--control-plane" in flags and "--forward-ms" in flags and "--rebalance-threshold" in flags
    named = {(p.name, f) for p in USER_DOCS for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", p.read_text())}
    unknown = sorted((doc, f) for doc, f in named if f not in flags | OTHER_TOOLS_FLAGS)
    assert not unknown, f"flags the docs name that no lockstep command takes: {unknown}"


def test_every_flag_of_the_services_is_in_docs_commands_md() -> None:
    doc = (ROOT / "docs/commands.md").read_text()
    missing = sorted((cmd, f) for cmd in ("rank", "serve", "coordinator") for f in help_flags(cmd)
                     if f != "--help" and not re.search(rf"`{f}\b", doc))
    assert not missing, f"flags docs/commands.md does not name: {missing}"


def _doc_default(value: object) -> str:
    if value is True:
        return "on"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if isinstance(value, int) else f"`{value}`"


def test_docs_commands_md_gives_each_setting_its_variable_and_default() -> None:
    """A row of the rank's and the coordinator's tables names the flag's variable, and starts its default column
    with the default the code applies (a row for a setting without one describes it in words)."""
    from lockstep.coordinator import config as coordinator
    from lockstep.rank import main as rank
    from lockstep.rank_auth import COORDINATOR_SETTINGS, RANK_SETTINGS

    doc = (ROOT / "docs/commands.md").read_text()
    sections = {"rank": doc.split("## `lockstep rank`")[1].split("\n## ")[0],
                "coordinator": doc.split("## `lockstep coordinator`")[1].split("\n## ")[0]}
    settings = {"rank": rank.SETTINGS + RANK_SETTINGS,
                "coordinator": coordinator.SETTINGS + coordinator.SCHEDULING + coordinator.FRONTENDS
                + coordinator.REBALANCE + COORDINATOR_SETTINGS}
    wrong = []
    for name, text in sections.items():
        rows = {f: line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| `--")
                for f in re.findall(r"`(--[a-z-]+)", line.split("|")[1])}
        for s in settings[name]:
            cells = rows.get(s.flag)
            if cells is None:
                wrong.append((name, s.flag, "no row"))
            elif not re.search(rf"\b{s.env}\b", cells[1]):
                wrong.append((name, s.flag, f"variable {s.env}, the row says {cells[1].strip()}"))
            elif s.default not in (None, "") and not cells[2].strip().startswith(_doc_default(s.default)):
                wrong.append((name, s.flag, f"default {s.default!r}, the row says {cells[2].strip()}"))
    assert not wrong, wrong
