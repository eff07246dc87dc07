"""Small helpers shared by the model tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import lcgen
from bench.runners import extra_cpu_buffers


def first_logits(model: lcgen.Model, prompt: str | list[int]) -> np.ndarray:
    """The logits after ``prompt`` (the first step's, seen by a hook that accepts)."""
    rows: list[np.ndarray] = []

    def record(step: lcgen.Step) -> None:
        rows.append(step.logits)

    with model.sequence(prompt) as seq:
        seq.generate(max_tokens=1, hooks=[record])
    return np.array(rows[0])


def llama_cpp_python(model: lcgen.Model, path: Path, **options: Any) -> Any:
    """llama-cpp-python's ``Llama`` on ``path``, with the CPU buffers ``model`` uses (lcgen
    turns llama.cpp's extra buffers off where AMX crashes; the other side must too)."""
    import llama_cpp

    with extra_cpu_buffers(model.extra_cpu_buffers):
        return llama_cpp.Llama(model_path=str(path), verbose=False, **options)
