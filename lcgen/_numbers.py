"""Numbers that arrive as numpy scalars (lcgen's own API returns numpy token ids:
``model.tokens_extending``, logits): options take them as the Python numbers they hold. And
flags, which must be flags."""

from __future__ import annotations

import numpy as np


def plain(value: object) -> object:
    """The Python int or float a numpy integer or floating-point scalar holds; any other value
    unchanged (so a bool, a numpy bool included, is still refused where a number is due)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: the most sequences a context holds


def check_bool(name: str, value: object, *, none: bool = False) -> None:
    """Refuse a flag that is not True or False (or None, where ``none`` allows it): a string
    such as ``"no"`` was taken as true."""
    if not (isinstance(value, bool) or (none and value is None)):
        allowed = "True, False or None" if none else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
