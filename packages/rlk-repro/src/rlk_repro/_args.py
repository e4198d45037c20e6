"""Argument types shared by rlk-repro's command lines."""

from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """An integer >= 1, or an argparse error naming the value."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= 1")
    return n
