"""``make bench``: lcgen against the raw llama.cpp loop and llama-cpp-python, and its checkpoint
operations against their targets (the package ``lcgen.bench``; options: ``--help``)."""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without installing: the repository root holds the lcgen package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lcgen.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
