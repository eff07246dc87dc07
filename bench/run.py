"""``make bench``: lcgen against the raw llama.cpp loop and llama-cpp-python, and its checkpoint
operations against their targets (the package ``bench`` beside this file; options: ``--help``)."""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # Python puts this script's folder first on the path: put the repository root there instead,
    # so that ``bench`` and ``lcgen`` come from the checkout and this folder's modules are not
    # importable as top-level ones.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    from bench import main

    raise SystemExit(main())
