"""The adaptive thread count: the tuner's decisions on simulated machines, and the invariant it
rests on, checked on the real models: the logits do not depend on the thread count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lcgen
from lcgen import model as model_module
from lcgen.registry import resolve
from lcgen.runtime import threads as threads_module
from lcgen.runtime.context import DecodeRequest
from lcgen.runtime.threads import (
    KEEP,
    PROBE_AFTER,
    PROBE_AFTER_MAX,
    PROBE_CALLS,
    PROBE_COST,
    ThreadTuner,
    own_cpu,
    size_class,
)


class Machine:
    """A CPU with ``n_max`` cores of which ``free`` are free: threads beyond the free cores
    share them and stall at every barrier (10x slower), and the process gets CPU time only on
    the cores it runs on. Times a decode of ``n_tokens`` tokens with the tuner's count."""

    def __init__(self, n_max: int, free: int) -> None:
        self.tuner = ThreadTuner(n_max, self._apply)
        self.free = free
        self.threads = n_max
        self.applied: list[int] = []
        self.seconds = 0.0

    def _apply(self, n: int) -> None:
        assert 1 <= n <= self.tuner.n_max and n != self.threads
        self.applied.append(n)
        self.threads = n

    def decode(self, n_tokens: int = 1) -> None:
        self.tuner.before(n_tokens)
        n = self.threads
        work = 0.01 * (1 + n_tokens / 64) / min(n, self.free)
        wall = work * (10 if n > self.free else 1)
        self.tuner.after(n_tokens, wall, min(n, self.free) * wall)
        self.seconds += wall


def test_an_idle_machine_keeps_every_thread_and_never_probes() -> None:
    machine = Machine(4, free=4)
    for i in range(5000):
        machine.decode(1 + i % 7)
    assert machine.tuner.n == 4 and machine.tuner.probes == 0 and machine.applied == []


def test_busy_cores_drop_the_count_to_the_free_ones_within_a_few_decodes() -> None:
    machine = Machine(8, free=8)
    for _ in range(20):
        machine.decode()
    machine.free = 5  # another program takes three cores
    for _ in range(KEEP + PROBE_CALLS):
        machine.decode()
    # Tried as soon as the CPU share of the last decodes falls short, kept as they were faster.
    assert machine.tuner.n == 5 and machine.applied == [5] and machine.tuner.probes == 1
    machine.free = 1
    for _ in range(KEEP + PROBE_CALLS):
        machine.decode()
    assert machine.tuner.n == 1 and machine.applied == [5, 1]


def test_a_share_that_misleads_costs_a_bounded_share_of_the_time() -> None:
    """A machine whose threads all run but whose CPU time reads one core short (threads that
    sleep while they wait): fewer threads are tried, found slower, and tried less and less."""

    class Sleepy(Machine):
        def decode(self, n_tokens: int = 1) -> None:
            self.tuner.before(n_tokens)
            wall = 0.01 / self.threads
            self.tuner.after(n_tokens, wall, (self.threads - 1) * wall)
            self.seconds += wall

    machine = Sleepy(4, free=4)
    spent = []
    while machine.seconds < 120:
        before = machine.seconds
        probes = machine.tuner.probes
        machine.decode()
        if machine.tuner.probes > probes or machine.threads != 4:
            spent.append(machine.seconds - before)
    assert machine.tuner.n == 4 and machine.tuner.changes == 0
    assert sum(spent) < 0.05 * machine.seconds  # the decodes probes took, and what followed


def test_freed_cores_are_taken_back_one_probe_at_a_time() -> None:
    machine = Machine(4, free=1)
    for _ in range(50):
        machine.decode()
    assert machine.tuner.n == 1
    machine.free = 4
    start = machine.seconds
    while machine.tuner.n < 4:
        machine.decode()
        assert machine.seconds - start < 10, "the freed cores were not taken back"
    assert machine.tuner.changes == 4  # down to 1, then up 2, 3, 4
    probes = machine.tuner.probes
    for _ in range(2000):
        machine.decode()
    assert machine.tuner.probes == probes  # none at the most threads


def test_a_probe_on_a_still_busy_machine_ends_at_its_first_stall_and_backs_off() -> None:
    machine = Machine(2, free=1)
    for _ in range(KEEP + PROBE_CALLS):
        machine.decode()
    assert machine.tuner.n == 1
    costs = []
    while machine.tuner.probes < 6:
        probes, before = machine.tuner.probes, machine.seconds
        machine.decode()
        if machine.tuner.probes > probes:
            costs.append(machine.seconds - before)
    assert all(cost == pytest.approx(0.1 * (1 + 1 / 64)) for cost in costs)  # one stalled decode
    assert machine.tuner.n == 1
    # The wait before the next probe doubles (up to its cap) and is never under PROBE_COST
    # times what the last one took: probes cost a bounded share of the time.
    assert machine.tuner._wait == max(PROBE_AFTER_MAX, PROBE_COST * costs[-1])


@settings(max_examples=60, deadline=None)
@given(
    n_max=st.integers(1, 8),
    phases=st.lists(
        st.tuples(st.integers(1, 8), st.lists(st.integers(1, 64), min_size=1, max_size=5)),
        min_size=1,
        max_size=4,
    ),
)
def test_the_count_settles_on_the_free_cores_whatever_came_before(
    n_max: int, phases: list[tuple[int, list[int]]]
) -> None:
    machine = Machine(n_max, free=n_max)
    for free, sizes in phases:
        machine.free = min(free, n_max)
        for i in range(60):
            machine.decode(sizes[i % len(sizes)])
            assert 1 <= machine.tuner.n <= n_max
    # Then a stable machine: the count reaches the free cores within bounded decoding time
    # (the longest wait a lost probe left, then one short wait per core taken back).
    start = machine.seconds
    while machine.seconds - start < 2 * (PROBE_AFTER_MAX + n_max * PROBE_AFTER):
        machine.decode(1)
    assert machine.tuner.n == machine.free
    assert all(b != a for a, b in zip([n_max, *machine.applied], machine.applied, strict=False))


def test_overlapping_decodes_each_count_their_own_share_of_the_process_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two models decoding in two threads: the process's CPU time over one decode holds the
    other's threads too, which read as this one's threads getting their cores."""
    clock = iter([0.0, 0.0, 1.0, 3.0, 4.0, 10.0, 11.0, 12.0]).__next__
    monkeypatch.setattr(threads_module.time, "perf_counter", clock)
    overlaps = threads_module.Overlaps()  # made at t=0
    a, b = threads_module.Span(2), threads_module.Span(2)
    overlaps.start(a)  # t=0
    overlaps.start(b)  # t=1: both run until t=3
    seconds_a = overlaps.end(a)  # t=3: 2 threads alone for 1 s, then 4 for 2 s
    seconds_b = overlaps.end(b)  # t=4: 4 threads for 2 s, then 2 alone for 1 s
    assert (seconds_a, seconds_b) == (10.0, 10.0)
    # Over A's 3 s the process ran 4 core-seconds: A's own share is 6 of those 10.
    assert own_cpu(4.0, 3.0, 2, seconds_a) == pytest.approx(4.0 * 6 / 10)
    alone = threads_module.Span(1)
    overlaps.start(alone)  # t=10, alone until t=11
    assert own_cpu(0.9, 1.0, 1, overlaps.end(alone)) == 0.9
    assert own_cpu(0.5, 0.0, 1, 0.0) == 0.5  # no time measured: as it is
    # A span that never started (Ctrl-C before it) ends as nothing: no threads left counted.
    assert overlaps.end(threads_module.Span(4)) == 0.0 and overlaps._threads == 0


def test_size_classes_group_batches_within_a_factor_two() -> None:
    assert [size_class(n) for n in (1, 2, 3, 4, 7, 8, 512)] == [1, 2, 2, 3, 3, 4, 10]


def test_the_default_is_adaptive_and_an_explicit_count_is_fixed(model_path: Path) -> None:
    # The count adapts on the CPU only: a model offloaded to a GPU (a GPU build) keeps it fixed.
    with lcgen.load(model_path, n_ctx=256) as default:
        assert default.adaptive_threads == (default.n_gpu_layers == 0)
    with lcgen.load(model_path, n_ctx=256, n_gpu_layers=0) as cpu:
        assert cpu.adaptive_threads and cpu.context.threads is not None
        assert cpu.context.threads.n_max == cpu.n_threads
        assert cpu.threads_now == cpu.context.threads.n
    with lcgen.load(model_path, n_ctx=256, n_threads=1) as fixed:
        assert not fixed.adaptive_threads and fixed.context.threads is None
        assert fixed.threads_now == fixed.n_threads == 1


def test_physical_cores_count_hardware_threads_of_one_core_once(tmp_path: Path) -> None:
    for cpu, (package, core) in enumerate([(0, 0), (0, 0), (0, 1), (0, 1), (1, 0)]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert model_module.physical_cores([0, 1, 2, 3, 4], tmp_path) == 3
    assert model_module.physical_cores([0, 1], tmp_path) == 1
    assert model_module.physical_cores([0, 7], tmp_path) == 2  # cpu7 unreadable: count CPUs


class Alternating(ThreadTuner):
    """Switches between 1 and the most threads at every decode."""

    def before(self, n_tokens: int) -> None:
        self.n = 1 if self.n != 1 else self.n_max
        self._apply(self.n)
        self.probes += 1


PROMPT = "The keeper of the lighthouse wrote in his log that the storm"


def _logits_and_tokens(model: lcgen.Model) -> tuple[np.ndarray, list[int], list[float]]:
    prompt = model.tokenize(PROMPT)
    requests = [DecodeRequest(i, prompt[: len(prompt) - i], 0) for i in range(3)]
    with model.context.in_use():
        batch = np.stack([row.copy() for row in model.context.decode(requests) if row is not None])
    for i in range(3):
        model.context.clear_slot(i)
    out = model.generate(PROMPT, max_tokens=24, temperature=0.9, seed=5, logprobs=1)
    return batch, list(out.tokens), [e.logprob for e in out.logprobs or []]


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_below_512_cells_logits_are_bit_identical_for_any_thread_count(
    name: str, model_path: Path
) -> None:
    if name == "smollm2-135m":
        path = model_path
    else:
        try:
            path = resolve(name, download=False)
        except lcgen.LcgenError:
            pytest.skip(f"{name} is not installed")
    results = []
    for threads in (1, 2, 3):
        with lcgen.load(path, n_ctx=512, n_threads=threads, cache=False) as m:
            results.append(_logits_and_tokens(m))
    with lcgen.load(path, n_ctx=512, n_threads=2, cache=False) as m:
        alternating = Alternating(2, m.context._handle.set_threads)
        m.context.threads = alternating
        results.append(_logits_and_tokens(m))
        assert alternating.probes > 24  # every decode switched
    first = results[0]
    for other in results[1:]:
        assert np.array_equal(first[0], other[0])  # a batch of three sequences
        assert other[1] == first[1] and other[2] == first[2]  # a sampled run, its logprobs


def test_macos_counts_its_performance_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from lcgen._native import cpu

    assert cpu.performance_cores() is None  # not macOS

    class Libc:
        def sysctlbyname(self, name: bytes, value: Any, size: Any, new: Any, n: int) -> int:
            assert name == b"hw.perflevel0.physicalcpu"
            value._obj.value = 6
            return 0

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(cpu.ctypes, "CDLL", lambda path: Libc())
    assert cpu.performance_cores() == 6
    monkeypatch.setattr(model_module, "performance_cores", lambda: 6)
    monkeypatch.setattr(model_module.os, "sched_getaffinity", lambda pid: set(range(10)))
    monkeypatch.setattr(model_module, "_cgroup_quota", lambda: None)
    assert model_module._default_threads() == 6  # not the 10 CPUs


def test_a_fixed_thread_count_is_reproducible_after_a_long_prompt(model_path: Path) -> None:
    # Past 512 cells a single token's attention is split between the threads (its logits then
    # depend on the count, see the README): with a fixed count, runs repeat bit for bit, and a
    # rewind regenerates the same tokens.
    prompt = " ".join([PROMPT] * 60)
    runs = []
    for _ in range(2):
        with lcgen.load(model_path, n_ctx=2048, n_threads=2, cache=False) as m:
            assert len(m.tokenize(prompt)) > 600 and not m.adaptive_threads
            out = m.generate(prompt, max_tokens=12, temperature=0.9, seed=5, logprobs=1)
            runs.append((list(out.tokens), [e.logprob for e in out.logprobs or []]))
            with m.sequence(m.tokenize(prompt)) as seq:
                first = seq.generate(max_tokens=12, temperature=0.9, seed=5)
                seq.rewind(12)
                again = seq.generate(max_tokens=12, temperature=0.9, seed=5)
                assert list(again.tokens) == list(first.tokens)
    assert runs[0] == runs[1]
