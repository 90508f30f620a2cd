"""Flags and environment, read one way by every service.

A flag wins over its environment variable and the variable over the default. A bad value of either is
an error that names the flag or the variable it came from (never a traceback), and every switch reads
its variable alike: `LOCKSTEP_PREFIX_CACHING=false` means the same to the rank, the coordinator and
`lockstep serve`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def integer(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("must be an integer") from None


def number(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("must be a number") from None
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("must be 0 or 1 (or true/false, on/off, yes/no)")


def string(text: str) -> str:
    return text.strip()


def at_least(low: float) -> Callable[[Any], str]:
    return lambda v: "" if v >= low else f"must be >= {low}, got {v}"


def within(low: float, high: float, low_open: bool = False) -> Callable[[Any], str]:
    """A range check; `low_open` excludes the lower bound, as for a share of memory."""
    left = "(" if low_open else "["

    def check(v: Any) -> str:
        ok = (v > low if low_open else v >= low) and v <= high
        return "" if ok else f"must be in {left}{low}, {high}], got {v}"

    return check


@dataclass(frozen=True)
class Setting:
    """One option of a service: its flag, its environment variable, how to read it and what is valid.

    A switch (`switch=True`) is a bare flag that sets `flag_value`; its variable is read as a boolean
    in the option's own sense (`--no-prefix-caching` sets False; `LOCKSTEP_PREFIX_CACHING=0` too).
    """

    dest: str
    flag: str
    env: str
    parse: Callable[[str], Any] = string
    default: Any = None
    help: str = ""
    check: Callable[[Any], str] | None = None
    switch: bool = False
    flag_value: Any = None


def add_settings(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    for s in settings:
        text = f"{s.help} (env {s.env}; default {s.default})" if s.help else f"env {s.env}"
        if s.switch:
            parser.add_argument(s.flag, dest=s.dest, action="store_const", const=s.flag_value, default=None,
                                help=text)
        else:
            parser.add_argument(s.flag, dest=s.dest, type=_flag_type(s), default=None, help=text)


def _flag_type(s: Setting) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        try:
            return s.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None

    read.__name__ = s.parse.__name__
    return read


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace, settings: Iterable[Setting],
            env: Mapping[str, str]) -> dict[str, Any]:
    """Each setting's value: flag, else variable, else default; exits through `parser.error` naming the
    flag or the variable when a value is not valid."""
    values: dict[str, Any] = {}
    for s in settings:
        value, origin = getattr(args, s.dest, None), s.flag
        raw = env.get(s.env, "").strip()
        if value is None and raw:
            origin = s.env
            try:
                value = boolean(raw) if s.switch else s.parse(raw)
            except ValueError as exc:
                parser.error(f"{s.env} {exc}, got {raw!r}")
        if value is None:
            value = s.default
        problem = s.check(value) if value is not None and s.check is not None else ""
        if problem:
            parser.error(f"{origin} {problem}")
        values[s.dest] = value
    return values
