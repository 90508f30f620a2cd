"""The coordinator's group list as text, and what changed between two lists (pure: no I/O, no clock).

A groups file (`--groups-file` / `LOCKSTEP_GROUPS_FILE`) holds one group per line, `NAME=HOST:PORT,HOST:PORT`
with the ranks in rank order; blank lines and lines starting with `#` are ignored, and `;` separates groups
too, so a `LOCKSTEP_GROUPS` string is a valid file. The coordinator re-reads the file while it runs and
applies `diff_groups` to its running groups, so the operator can add and remove groups without restarting
it (a restart would drop the requests in flight on every group).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Groups = dict[str, tuple[str, ...]]


def parse_group_list(text: str) -> Groups:
    """Group name -> rank addresses, in the order written; ValueError names the first bad entry.

    An empty list is allowed here (the caller decides whether no group is an error)."""
    groups: Groups = {}
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        for part in filter(None, (p.strip() for p in line.split(";"))):
            name, sep, addrs = part.partition("=")
            addresses = tuple(a.strip() for a in addrs.split(",") if a.strip())
            if not sep or not name.strip() or not addresses:
                raise ValueError(f"a group is NAME=HOST:PORT[,HOST:PORT...], got {part!r}")
            if name.strip() in groups:
                raise ValueError(f"group {name.strip()!r} is listed twice")
            groups[name.strip()] = addresses
    _check_addresses(groups)
    return groups


def _check_addresses(groups: Groups) -> None:
    """Every address a HOST:PORT, and each rank in one group once: a rank serves one Step stream, so two groups
    naming it would take it from each other for ever."""
    seen: dict[str, str] = {}
    for name, addresses in groups.items():
        for a in addresses:
            host, _, port = a.rpartition(":")
            if not host or any(c.isspace() for c in a) or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"group {name!r}: {a!r} is not HOST:PORT")
            if a in seen:
                raise ValueError(f"rank address {a} is listed twice in group {name!r}" if seen[a] == name else
                                 f"rank address {a} is listed for groups {seen[a]!r} and {name!r}: a rank serves "
                                 "one group")
            seen[a] = name


def format_group_list(groups: Mapping[str, tuple[str, ...] | list[str]]) -> str:
    """The file's text for these groups: one line each, in order, ending with a newline."""
    return "".join(f"{name}={','.join(addresses)}\n" for name, addresses in groups.items())


@dataclass(frozen=True)
class GroupsDiff:
    """What turns the running groups into the listed ones. A group whose addresses changed is another group
    at the same name (new ranks): it is removed, then added with `changed`'s addresses."""

    added: Groups = field(default_factory=dict)
    removed: tuple[str, ...] = ()
    changed: Groups = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def diff_groups(running: Mapping[str, tuple[str, ...]], listed: Mapping[str, tuple[str, ...]]) -> GroupsDiff:
    """The groups to start, to remove and to replace, each in the order its list names them."""
    return GroupsDiff(
        added={n: tuple(a) for n, a in listed.items() if n not in running},
        removed=tuple(n for n in running if n not in listed),
        changed={n: tuple(a) for n, a in listed.items() if n in running and tuple(running[n]) != tuple(a)},
    )
