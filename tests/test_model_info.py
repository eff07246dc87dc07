"""What a model says about itself: its real parameter count, its backend and the layers it
offloaded (llama.cpp's own description names a size class: "256M" for a 135M model)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import lcgen
from lcgen._native.log import supports_gpu_offload
from lcgen._native.model import _offloaded_layers, gpu_devices
from lcgen.model import backend_summary, describe, params_label


@pytest.mark.parametrize(
    ("n_params", "label"),
    [
        (134_515_008, "135M"),
        (999_600_000, "1B"),
        (1_543_714_304, "1.54B"),
        (7_241_732_096, "7.24B"),
        (12_345, "12.3K"),
        (500, "500"),
    ],
)
def test_params_label(n_params: int, label: str) -> None:
    assert params_label(n_params) == label


@pytest.mark.parametrize(
    ("llama_description", "n_params", "description"),
    [
        ("llama 256M Q4_1", 134_515_008, "llama 135M Q4_1"),
        ("qwen2 1.5B Q4_K - Medium", 1_543_714_304, "qwen2 1.54B Q4_K - Medium"),
        ("odd", 10, "odd, 10 parameters"),
    ],
)
def test_describe_puts_the_real_count_in(
    llama_description: str, n_params: int, description: str
) -> None:
    assert describe(llama_description, n_params) == description


@pytest.mark.parametrize(
    ("devices", "offloaded", "summary"),
    [
        ((), 0, "CPU"),
        ((("CUDA", "NVIDIA H100"),), 31, "CUDA: 31/31 layers offloaded"),
        ((("CUDA", "A"), ("CUDA", "B")), 12, "CUDA: 12/31 layers offloaded"),
        ((("Metal", "Apple M2"),), 0, "CPU (Metal built in, 0/31 layers offloaded)"),
    ],
)
def test_backend_summary(
    devices: tuple[tuple[str, str], ...], offloaded: int, summary: str
) -> None:
    assert backend_summary(devices, offloaded, 31) == summary


@pytest.mark.parametrize(
    ("requested", "on_gpu", "expected"),
    [
        (-1, True, (31, 31)),
        (10, True, (31, 10)),
        (99, True, (31, 31)),
        (0, True, (31, 0)),
        (-1, False, (31, 0)),
    ],
)
def test_offloaded_layers_count_as_llama_cpp_does(
    requested: int, on_gpu: bool, expected: tuple[int, int]
) -> None:
    devices = (("CUDA", "GPU"),) if on_gpu else ()
    assert _offloaded_layers(requested, 30, devices) == expected


def test_repr_shows_the_real_size_and_the_backend(model: lcgen.Model) -> None:
    text = repr(model)
    assert model.description in text and model.backend in text
    label = params_label(model.n_params)
    assert model.description.split()[1] == label
    assert model.metadata("general.size_label") in {None, label}  # the GGUF's own label agrees
    assert model.n_params > 0
    assert (model.n_gpu_layers > 0) == (not model.backend.startswith("CPU"))
    if not gpu_devices():  # a CPU-only build holds every layer on the CPU
        assert model.backend == "CPU" and model.n_gpu_layers == 0


def test_no_layers_offloaded_when_asked_for_none(model: lcgen.Model, model_path: Path) -> None:
    with lcgen.Model(model_path, n_gpu_layers=0, n_ctx=256, n_threads=1) as cpu:
        assert cpu.n_gpu_layers == 0 and cpu.backend.startswith("CPU")
        assert (cpu.n_params, cpu.description) == (model.n_params, model.description)
    assert "closed" in repr(cpu) and cpu.description in repr(cpu)


def test_layers_asked_for_on_a_build_without_a_gpu_say_where_they_run(model_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lcgen.Model(model_path, n_gpu_layers=2, n_ctx=256, n_threads=1) as asked:
            offloaded = asked.n_gpu_layers
    said = [str(w.message) for w in caught if "n_gpu_layers" in str(w.message)]
    assert all(w.filename == __file__ for w in caught if "n_gpu_layers" in str(w.message))
    if supports_gpu_offload():
        assert offloaded == 2 and not any("no GPU backend" in m for m in said)
    else:  # the layers ran on the CPU: a warning says so (lcgen info shows "CPU")
        assert offloaded == 0
        assert said == [
            "n_gpu_layers=2: this build of llama-cpp-python has no GPU backend, so every layer "
            "runs on the CPU (README: GPU and Metal)"
        ]
