"""Locate data files shipped with lcgen (``models.toml``, ``grammars/``).

An installed wheel carries them inside the package (hatchling's force-include puts them at
``lcgen/models.toml`` and ``lcgen/grammars/``); an editable checkout keeps them at the
repository root, next to the ``lcgen/`` folder.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def resource_path(name: str) -> Path:
    """Return the path of a data file or folder shipped with lcgen.

    Args:
        name: the resource's name relative to the package, e.g. ``"models.toml"`` or
            ``"grammars"``.

    Returns:
        The path inside the installed package if it exists there, else the path at the
        repository root of an editable checkout.

    Raises:
        FileNotFoundError: the resource is in neither place (a broken install: reinstall lcgen).
    """
    candidates = (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name)
    for candidate in candidates:
        if candidate.exists():
            return candidate
    tried = " or ".join(str(candidate) for candidate in candidates)
    raise FileNotFoundError(
        f"lcgen resource {name!r} not found at {tried}; reinstall lcgen, or run it from a "
        "complete checkout of its repository"
    )


def user_cache_dir() -> Path:
    """lcgen's folder in the user's cache: ``$XDG_CACHE_HOME/lcgen``, else ``~/.cache/lcgen``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lcgen"
