"""lcgen's exception hierarchy, and the contract of what raises what.

Every error lcgen raises on purpose is an :class:`LcgenError`, except bad arguments at the
public boundary: those raise ``ValueError`` or ``TypeError`` naming the offending value. A
failure inside llama.cpp never ends the process: lcgen checks what llama.cpp would abort on
before calling it, and turns every failing return code into one of these errors, with the
reason llama.cpp logged. ``assert`` guards lcgen's own invariants only.
"""

from __future__ import annotations

import os
import sys
import warnings


class LcgenError(Exception):
    """Base class of every error lcgen raises."""


class ModelNotFoundError(LcgenError):
    """A model name, path or ``hf:`` reference could not be resolved to a local GGUF file."""


class ModelLoadError(LcgenError):
    """llama.cpp could not load a GGUF file (missing, not GGUF, truncated, unsupported)."""


class ClosedError(LcgenError):
    """The model, sequence or grammar state was closed; it cannot be used any more."""


class ContextFullError(LcgenError):
    """A sequence would grow past the context size, or the KV cache has no free cells."""


class SlotsExhaustedError(LcgenError):
    """Every sequence slot of the context is in use."""


class SlotBusyError(SlotsExhaustedError):
    """No slot now, in a thread that holds slots and asked not to wait for other threads'
    (``model.cache.without_waiting()``: the scheduler admits work so, and retries later)."""


class DecodeError(LcgenError):
    """``llama_decode`` failed for a reason other than a full context."""


class GrammarError(LcgenError):
    """A grammar could not be parsed, or a token it forbids was forced."""


class GrammarTooSlowError(GrammarError):
    """One mask of the vocabulary by a grammar would take longer than lcgen's bound
    (:data:`lcgen.constrain.grammar.MAX_MASK_SECONDS`): the model would wait that long for
    each such token."""


class UnsupportedSchemaError(GrammarError):
    """A valid JSON Schema that uses what lcgen cannot enforce (a keyword or a combination of
    them, a format, a size past lcgen's bounds). An invalid schema, or one no value validates,
    is a plain :class:`GrammarError`: a caller may fall back to a looser grammar for this one
    only (``lcgen serve`` does, for a ``response_format`` that is not strict)."""


class NoCandidatesError(LcgenError):
    """Every token is ruled out at a position: exclusions, bans and the grammar together."""


class RewindError(LcgenError):
    """A rewind target is not reachable from the sequence's current state."""


class StateFileError(LcgenError):
    """A saved sequence file is corrupt, truncated, of another model or another format version."""


class IncompleteOutputError(LcgenError):
    """Generation stopped before a constrained output was complete.

    Attributes:
        text: the partial output generated so far.
        state: from a continuous generator, the :class:`~lcgen.SequenceState` it made (every
            element, complete or not); None elsewhere.
    """

    def __init__(self, message: str, text: str, state: object = None) -> None:
        super().__init__(message)
        self.text = text
        self.state = state


class SchemaValidationError(LcgenError, ValueError):
    """Constrained output matched a pydantic model's JSON Schema, but the model's own validation
    refused it: the model checks more than its schema says (a naive datetime, a decimal given as
    a string, numeric dict keys, a future date...), which a grammar cannot enforce.

    Attributes:
        text: the JSON text generated.
        errors: pydantic's errors (``ValidationError.errors()``: location, message, input).

    The pydantic ``ValidationError`` is the exception's ``__cause__``.
    """

    def __init__(self, message: str, text: str, errors: list[dict[str, object]]) -> None:
        super().__init__(message)
        self.text = text
        self.errors = errors


class BatchMismatchError(LcgenError):
    """Two sequence states were combined whose batch sizes differ (and neither is 1)."""


class SampleMismatchError(LcgenError):
    """Two sequence states were combined whose sample counts differ (and neither is 1), or
    samples were asked of a state that already has several per batch element."""


# Earlier names, kept so existing code keeps working.
SequenceClosedError = ClosedError
BatchMismatch = BatchMismatchError
SampleMismatch = SampleMismatchError


def warn(message: str) -> None:
    """``warnings.warn`` a UserWarning at the first caller outside lcgen: the user's own line,
    however deep inside lcgen the warning was raised."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
