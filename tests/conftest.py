"""Shared fixtures: the bundled SmolLM2-135M model, loaded once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import lcgen
from lcgen.models import resolve


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve("smollm2-135m", download=False)


@pytest.fixture(scope="session")
def model(model_path: Path) -> Iterator[lcgen.Model]:
    with lcgen.Model(model_path) as m:
        yield m
