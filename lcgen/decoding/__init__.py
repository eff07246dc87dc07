"""One position, no KV cache: options made into a :class:`Plan`, sampling, text (UTF-8 and stop
strings), results (:class:`Chunk`, :class:`Text`, :class:`ToolCall`, :class:`GenerationStats`),
what hooks see and return, and the :class:`Generator` (logits in, chunk out)."""

from lcgen.decoding.generator import Generator, GeneratorState
from lcgen.decoding.hooks import Override, Resample, Rewind, Step
from lcgen.decoding.options import GenerateOptions, Plan, make_plan
from lcgen.decoding.results import (
    Chunk,
    GenerationStats,
    Text,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)
from lcgen.decoding.sampling import SamplerConfig

__all__ = [
    "Chunk",
    "GenerateOptions",
    "GenerationStats",
    "Generator",
    "GeneratorState",
    "Override",
    "Plan",
    "Resample",
    "Rewind",
    "SamplerConfig",
    "Step",
    "Text",
    "TokenLogprob",
    "ToolCall",
    "TopLogprob",
    "make_plan",
]
