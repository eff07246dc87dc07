"""lcgen: controllable, reversible generation with GGUF models on llama.cpp.

import lcgen
model = lcgen.load("smollm2-135m")
print(model.generate("Once upon a time", max_tokens=64))
"""

from __future__ import annotations

import os
from typing import Any

from lcgen import generate
from lcgen.checkpoint import Checkpoint, SequenceStats
from lcgen.continuous import SequenceState, continuous
from lcgen.errors import (
    BatchMismatch,
    ContextFullError,
    DecodeError,
    GrammarError,
    IncompleteOutputError,
    LcgenError,
    ModelLoadError,
    ModelNotFoundError,
    NoCandidatesError,
    RewindError,
    SampleMismatch,
    SequenceClosedError,
    SlotsExhaustedError,
    StateFileError,
)
from lcgen.generator import Chunk, GenerateOptions, GenerationStats, Generator, GeneratorState, Text
from lcgen.grammar import Grammar, GrammarState
from lcgen.hooks import Override, Resample, Rewind, Step
from lcgen.model import Model
from lcgen.sampling import SamplerConfig
from lcgen.sequence import Sequence

__version__ = "0.1.0"

DEFAULT_MODEL = "smollm2-135m"


def load(ref: str | os.PathLike[str] = DEFAULT_MODEL, **options: Any) -> Model:
    """Load a model by registry name, ``.gguf`` path or ``hf:org/repo/file.gguf`` reference.

    Args:
        ref: what to load; see ``lcgen models`` for the registry names.
        **options: passed to :class:`Model` (n_ctx, n_batch, n_seq_max, n_gpu_layers,
            n_threads, verbose).

    Returns:
        The loaded model.

    Raises:
        ModelNotFoundError: ``ref`` cannot be resolved to a local file (the message says how
            to get it).
        ModelLoadError: llama.cpp cannot load the file.
    """
    from lcgen.models import resolve

    return Model(resolve(ref), **options)


__all__ = [
    "DEFAULT_MODEL",
    "BatchMismatch",
    "Checkpoint",
    "Chunk",
    "ContextFullError",
    "DecodeError",
    "GenerateOptions",
    "GenerationStats",
    "Generator",
    "GeneratorState",
    "Grammar",
    "GrammarError",
    "GrammarState",
    "IncompleteOutputError",
    "LcgenError",
    "Model",
    "ModelLoadError",
    "ModelNotFoundError",
    "NoCandidatesError",
    "Override",
    "Resample",
    "Rewind",
    "RewindError",
    "SampleMismatch",
    "SamplerConfig",
    "Sequence",
    "SequenceClosedError",
    "SequenceState",
    "SequenceStats",
    "SlotsExhaustedError",
    "StateFileError",
    "Step",
    "Text",
    "continuous",
    "generate",
    "load",
]
