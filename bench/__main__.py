"""``python -m bench`` from the repository root: the same as ``python bench/run.py``."""

from bench import main

if __name__ == "__main__":
    raise SystemExit(main())
