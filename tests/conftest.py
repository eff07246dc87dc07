"""Shared fixtures: the bundled SmolLM2-135M model, loaded once per test session.

``LCGEN_TEST_MODEL=path.gguf`` puts another GGUF in its place (e.g. the tiny random model that
``tests/tiny_model.py`` builds, for a machine the bundled model cannot be carried to).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import lcgen
from lcgen.registry import resolve


@pytest.fixture(scope="session")
def model_path() -> Path:
    override = os.environ.get("LCGEN_TEST_MODEL")
    if override:
        return Path(override).resolve()
    return resolve("smollm2-135m", download=False)


@pytest.fixture(scope="session")
def model(model_path: Path) -> Iterator[lcgen.Model]:
    with lcgen.Model(model_path) as m:
        yield m
