"""Argument types shared by every ``gdn-cp`` command: one syntax for integers and lists.

An integer is an optional minus sign and ASCII digits (``int()`` alone would also take ``1_000``,
``" 12 "`` and other scripts' digits). A list is comma-separated items; spaces around an item are
ignored, an empty item (``0,,8``) or a space inside one (``128 256``) is an error, never a
silent join or drop. Each type raises ``argparse.ArgumentTypeError``, so argparse reports
``argument --flag: <why>`` and exits with status 2 before the command runs.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Callable, Optional

__all__ = ["comma_items", "existing_path", "int_list", "int_range", "parse_int"]

_INT = re.compile(r"-?[0-9]+")


def parse_int(text: str) -> int:
    """``text`` (surrounding spaces ignored) as an int; ArgumentTypeError otherwise."""
    item = text.strip()
    if not _INT.fullmatch(item):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (digits, optionally with a leading -)")
    return int(item)


def comma_items(text: str, *, unique: bool = False) -> list[str]:
    """The items of a comma-separated list, stripped; no empty items; no repeats when ``unique``."""
    items = [v.strip() for v in text.split(",")]
    if any(v == "" for v in items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
    if unique:
        repeated = sorted({v for v in items if items.count(v) > 1})
        if repeated:
            raise argparse.ArgumentTypeError(f"{', '.join(repeated)} listed twice in {text!r}")
    return items


def int_range(low: int, high: Optional[int] = None, *, high_why: str = "") -> Callable[[str], int]:
    """An argparse type: an int in ``[low, high]`` (no upper bound when ``high`` is None); ``high_why``
    follows the message of a value over ``high`` (what the bound is)."""

    def parse(text: str) -> int:
        value = parse_int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value} must be <= {high}{high_why}")
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def int_list(low: Optional[int] = None, *, count: Optional[int] = None, unique: bool = False) -> Callable[[str], list[int]]:
    """An argparse type: a comma-separated list of ints (each >= ``low`` when given), exactly
    ``count`` of them when given."""

    def parse(text: str) -> list[int]:
        values = [parse_int(v) for v in comma_items(text)]
        repeated = sorted({v for v in values if values.count(v) > 1}) if unique else []
        if repeated:
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, repeated))} listed twice in {text!r}")
        if count is not None and len(values) != count:
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated integers, got {len(values)} in {text!r}")
        if low is not None:
            bad = [v for v in values if v < low]
            if bad:
                raise argparse.ArgumentTypeError(f"every value must be >= {low}, got {bad[0]} in {text!r}")
        return values

    parse.__name__ = "list"
    return parse


def existing_path(text: str) -> str:
    """An argparse type: a path that exists (``~`` expanded), for the flags and arguments that name where
    megatron-core is; what it is inside is the command's to check."""
    if not os.path.exists(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text} does not exist; pass a Megatron-LM checkout, a site-packages "
                                         "folder holding megatron-core or the megatron package folder (or leave it "
                                         "out: the megatron-core this Python imports)")
    return text
