"""Numbers that arrive as numpy scalars (lcgen's own API returns numpy token ids:
``model.tokens_extending``, logits): options take them as the Python numbers they hold."""

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
