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
import lcgen.model as model_module
from lcgen.registry import resolve


@pytest.fixture(scope="session")
def model_path() -> Path:
    override = os.environ.get("LCGEN_TEST_MODEL")
    if override:
        return Path(override).resolve()
    return resolve("smollm2-135m", download=False)


# The suite compares outputs across calls, so its shared models keep a fixed thread count, as
# the README advises such a suite: an adapting count (the default) picks where short batches
# are padded by measured decode times, and splits long attention by the count it has, so two
# runs may differ in the logits' last bits. Tests of the adapting count load their own models.
THREADS = model_module._default_threads()


@pytest.fixture(scope="session")
def model(model_path: Path) -> Iterator[lcgen.Model]:
    with lcgen.Model(model_path, n_threads=THREADS) as m:
        yield m


@pytest.fixture(scope="session")
def cold_model(model_path: Path) -> Iterator[lcgen.Model]:
    """The same model without a prefix cache: a reference that decodes every prompt from the
    start (a cached prefix was decoded in other batch chunks, so its logits can differ in the
    last bits)."""
    with lcgen.Model(model_path, n_threads=THREADS, cache=False) as m:
        yield m


@pytest.fixture(autouse=True)
def _isolated_cache(request: pytest.FixtureRequest) -> None:
    """Each test starts with nothing parked in the shared model's KV store: no test depends on
    what another cached, and new cells go into a pool without holes (logits depend in their
    last bits on the order of a sequence's cells in the pool)."""
    for name in ("model", "cold_model"):
        if name in request.fixturenames:
            request.getfixturevalue(name).cache.clear()
