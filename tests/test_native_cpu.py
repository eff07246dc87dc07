"""The extra-CPU-buffer decision (AMX that a machine reports but cannot run kills the process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lcgen._native import cpu


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Probe calls, recorded; the verdict cache in a temporary folder."""
    calls: list[str] = []
    monkeypatch.delenv(cpu.ENV, raising=False)
    monkeypatch.setattr(cpu, "_cache_file", lambda: tmp_path / "verdicts.json")
    monkeypatch.setattr(cpu, "_known", {})
    monkeypatch.setattr(cpu, "_cpu_reports_amx", lambda: True)
    return calls


def fake_probe(calls: list[str], verdict: bool | None) -> object:
    def probe(path: str) -> bool | None:
        calls.append(path)
        return verdict

    return probe


def test_the_environment_decides_without_a_probe(
    probes: list[str], monkeypatch: pytest.MonkeyPatch, model_path: Path
) -> None:
    monkeypatch.setattr(cpu, "_probe", fake_probe(probes, False))
    monkeypatch.setenv(cpu.ENV, "1")
    assert cpu.extra_buffers_usable(str(model_path))
    monkeypatch.setenv(cpu.ENV, "0")
    assert not cpu.extra_buffers_usable(str(model_path))
    assert probes == []


def test_no_amx_no_probe(
    probes: list[str], monkeypatch: pytest.MonkeyPatch, model_path: Path
) -> None:
    monkeypatch.setattr(cpu, "_cpu_reports_amx", lambda: False)
    monkeypatch.setattr(cpu, "_probe", fake_probe(probes, False))
    assert cpu.extra_buffers_usable(str(model_path))
    assert probes == []


def test_a_crashing_probe_turns_the_buffers_off_for_the_machine(
    probes: list[str], monkeypatch: pytest.MonkeyPatch, model_path: Path, tmp_path: Path
) -> None:
    monkeypatch.setattr(cpu, "_probe", fake_probe(probes, False))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert not cpu.extra_buffers_usable(str(model_path))
    assert not cpu.extra_buffers_usable(str(other))  # the machine's verdict, no second probe
    monkeypatch.setattr(cpu, "_known", {})  # a new process reads the stored verdict
    assert not cpu.extra_buffers_usable(str(model_path))
    assert probes == [str(model_path)]


def test_a_passing_probe_is_remembered_per_model(
    probes: list[str], monkeypatch: pytest.MonkeyPatch, model_path: Path, tmp_path: Path
) -> None:
    monkeypatch.setattr(cpu, "_probe", fake_probe(probes, True))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert cpu.extra_buffers_usable(str(model_path))
    assert cpu.extra_buffers_usable(str(model_path))
    assert cpu.extra_buffers_usable(str(other))
    assert probes == [str(model_path), str(other)]


def test_an_inconclusive_probe_keeps_the_default_and_is_not_stored(
    probes: list[str], monkeypatch: pytest.MonkeyPatch, model_path: Path
) -> None:
    monkeypatch.setattr(cpu, "_probe", fake_probe(probes, None))
    assert cpu.extra_buffers_usable(str(model_path))
    assert cpu.extra_buffers_usable(str(model_path))
    assert len(probes) == 2


def test_the_real_probe_gives_a_verdict(model_path: Path) -> None:
    """On this machine the probe decodes (True) or dies of a signal (False), never fails
    another way."""
    assert cpu._probe(str(model_path)) in (True, False)


def test_the_real_probe_is_inconclusive_on_a_file_it_cannot_load(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert cpu._probe(str(bad)) is None
