"""lcgen's exception hierarchy: every error lcgen raises on purpose is an ``LcgenError``."""

from __future__ import annotations


class LcgenError(Exception):
    """Base class of every error lcgen raises."""


class ModelNotFoundError(LcgenError):
    """A model name, path or ``hf:`` reference could not be resolved to a local GGUF file."""


class ModelLoadError(LcgenError):
    """llama.cpp could not load a GGUF file (missing, not GGUF, truncated, unsupported)."""


class ContextFullError(LcgenError):
    """A sequence would grow past the context size, or the KV cache has no free cells."""


class SlotsExhaustedError(LcgenError):
    """Every sequence slot of the context is in use."""


class DecodeError(LcgenError):
    """``llama_decode`` failed for a reason other than a full context."""


class SequenceClosedError(LcgenError):
    """An operation was attempted on a sequence that was closed."""


class GrammarError(LcgenError):
    """A grammar could not be parsed, or a token it forbids was forced."""


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
    """

    def __init__(self, message: str, text: str) -> None:
        super().__init__(message)
        self.text = text


class BatchMismatch(LcgenError):
    """Two sequence states were combined whose batch sizes differ (and neither is 1)."""


class SampleMismatch(LcgenError):
    """Two sequence states were combined whose sample counts differ (and neither is 1), or
    samples were asked of a state that already has several per batch element."""
