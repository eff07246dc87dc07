"""lcgen: controllable, reversible generation with GGUF models on llama.cpp.

::

    import lcgen
    model = lcgen.load("smollm2-135m")
    print(model.generate("Once upon a time", max_tokens=64))

The public names, by layer (each layer imports only from those listed before it):

- errors: :class:`LcgenError` and its subclasses.
- vocabulary: ``model.vocab``, a :class:`~lcgen.vocab.Vocab`.
- constraints: :class:`Grammar`, :class:`GrammarState`, :func:`bundle_schema`.
- one position: :class:`Generator`, :class:`GeneratorState`, :class:`SamplerConfig`,
  :class:`Chunk`, :class:`Text`, :class:`GenerationStats`, :class:`TokenLogprob`,
  :class:`TopLogprob`, the hook values :class:`Step`,
  :class:`Override`, :class:`Resample`, :class:`Rewind`, and :class:`GenerateOptions` /
  :class:`Plan` / :func:`make_plan` (generation options made into a value).
- live KV: :class:`Sequence`, :class:`Checkpoint`, :class:`SequenceStats`, the runs
  :class:`PlainRun` and :class:`Backtracker`, and the :class:`Scheduler`.
- continuous: :class:`SequenceState`, :func:`continuous`, :class:`Continuous`, and
  ``lcgen.generate`` (the specs ``text``, ``choice``, ``json``, ``regex``, ``grammar``).
- function calling: :class:`Tool` (a function the model may call) and :class:`ToolCall` (a
  call a reply asks for); ``lcgen.tools`` holds the rest.
- entry points: :func:`load`, :class:`Model` (``model.chat(messages, tools=[...])``).
"""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any

from lcgen._version import __version__ as __version__
from lcgen.constrain import Grammar, GrammarState, bundle_schema
from lcgen.continuous import Continuous, SequenceState, continuous
from lcgen.continuous import specs as generate
from lcgen.decoding import (
    Chunk,
    GenerateOptions,
    GenerationStats,
    Generator,
    GeneratorState,
    Override,
    Plan,
    Resample,
    Rewind,
    SamplerConfig,
    Step,
    Text,
    TokenLogprob,
    TopLogprob,
    make_plan,
)
from lcgen.errors import (
    BatchMismatch,
    BatchMismatchError,
    ClosedError,
    ContextFullError,
    DecodeError,
    GrammarError,
    GrammarTooSlowError,
    IncompleteOutputError,
    LcgenError,
    ModelLoadError,
    ModelNotFoundError,
    NoCandidatesError,
    RewindError,
    SampleMismatch,
    SampleMismatchError,
    SchemaValidationError,
    SequenceClosedError,
    SlotBusyError,
    SlotsExhaustedError,
    StateFileError,
    UnsupportedSchemaError,
)
from lcgen.model import KV_CACHE_TYPES, Model
from lcgen.runtime import (
    Backtracker,
    Checkpoint,
    PlainRun,
    Scheduler,
    Sequence,
    SequenceStats,
    check_draft_model,
)
from lcgen.tools import Tool, ToolCall

DEFAULT_MODEL = "smollm2-135m"


def load(ref: str | os.PathLike[str] = DEFAULT_MODEL, **options: Any) -> Model:
    """Load a model by registry name, ``.gguf`` path or ``hf:org/repo/file.gguf`` reference.

    Args:
        ref: what to load; see ``lcgen models`` for the registry names.
        **options: passed to :class:`Model` (n_ctx, n_batch, n_seq_max, n_gpu_layers,
            n_threads, flash_attn, type_k, type_v, swa_full, cache, slot_timeout,
            pad_batches, verbose).

    Returns:
        The loaded model.

    Raises:
        ModelNotFoundError: ``ref`` cannot be resolved to a local file (the message says how
            to get it).
        ModelLoadError: llama.cpp cannot load the file.
    """
    from lcgen.model import check_load_options
    from lcgen.registry import resolve

    # Checked before the model is resolved, which may download it.
    parameters = inspect.signature(Model).parameters
    for name in options:
        if name == "path" or name not in parameters:
            close = difflib.get_close_matches(name, list(parameters)[1:], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"lcgen.load() got an unexpected keyword argument {name!r}{hint}")
    defaults = {n: p.default for n, p in parameters.items() if n != "path"}
    check_load_options(**{**defaults, **options})
    return Model(resolve(ref), **options)


__all__ = [
    "DEFAULT_MODEL",
    "KV_CACHE_TYPES",
    "Backtracker",
    "BatchMismatch",
    "BatchMismatchError",
    "Checkpoint",
    "Chunk",
    "ClosedError",
    "ContextFullError",
    "Continuous",
    "DecodeError",
    "GenerateOptions",
    "GenerationStats",
    "Generator",
    "GeneratorState",
    "Grammar",
    "GrammarError",
    "GrammarState",
    "GrammarTooSlowError",
    "IncompleteOutputError",
    "LcgenError",
    "Model",
    "ModelLoadError",
    "ModelNotFoundError",
    "NoCandidatesError",
    "Override",
    "PlainRun",
    "Plan",
    "Resample",
    "Rewind",
    "RewindError",
    "SampleMismatch",
    "SampleMismatchError",
    "SamplerConfig",
    "Scheduler",
    "SchemaValidationError",
    "Sequence",
    "SequenceClosedError",
    "SequenceState",
    "SequenceStats",
    "SlotBusyError",
    "SlotsExhaustedError",
    "StateFileError",
    "Step",
    "Text",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "TopLogprob",
    "UnsupportedSchemaError",
    "bundle_schema",
    "check_draft_model",
    "continuous",
    "generate",
    "load",
    "make_plan",
]
