"""Continuous generation: :class:`SequenceState` values (batch x samples x text, each element
keeping its KV cache), the generation specs of :mod:`~lcgen.continuous.specs` (``lcgen.generate``)
that :func:`continuous` makes callable on them, the element pool, and beam search."""

from lcgen.continuous import specs
from lcgen.continuous.specs import GenerateSpec
from lcgen.continuous.state import Continuous, SequenceState, continuous

__all__ = ["Continuous", "GenerateSpec", "SequenceState", "continuous", "specs"]
