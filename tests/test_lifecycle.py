"""A long-running process's edges: Ctrl-C right between two steps that must go together (a lock
taken and its release, stderr redirected and given back, a decode counted in and out), threads
compiling constraints at once, and a daemon thread still generating when the program exits.
Each interrupt is put where a ``KeyboardInterrupt`` can land: right after a call returns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import lcgen
from lcgen._native import log
from lcgen.runtime import threads as threads_module


class _InterruptedAfter:
    """A stand-in for a lock whose ``acquire`` takes it, then is interrupted (Ctrl-C as the
    call returned)."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        self.lock.acquire(*args, **kwargs)
        raise KeyboardInterrupt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lock, name)


def test_ctrl_c_right_after_the_beam_turn_is_taken_gives_it_back(model: lcgen.Model) -> None:
    # The turn stayed held: every later beam search, in any thread, waited for ever.
    store = model.cache
    turn = store._beam_turn
    store._beam_turn = _InterruptedAfter(turn)  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt), store.beam_turn():
            pass
    finally:
        store._beam_turn = turn
    got: list[bool] = []

    def take() -> None:
        got.append(turn.acquire(timeout=5))
        if got[-1]:
            turn.release()

    other = threading.Thread(target=take)
    other.start()
    other.join(10)
    assert got == [True]  # free for another thread's search
    beams = lcgen.continuous(lcgen.generate.text(model, max_tokens=3, beams=2))
    assert len(list(beams("The capital of France is"))) >= 1  # (a search runs)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
@pytest.mark.parametrize("step", [1, 2])
def test_ctrl_c_while_stderr_is_captured_gives_fd_2_back(
    monkeypatch: pytest.MonkeyPatch, step: int
) -> None:
    # Interrupted after the redirect (step 1) or as it was undone (step 2): fd 2 stayed in a
    # deleted temporary file for good, or a copy of it leaked.
    before, fds = os.fstat(2), _fds()
    dup2, calls = os.dup2, []

    def interrupted(fd: int, fd2: int, *args: Any) -> int:
        result = dup2(fd, fd2, *args)
        calls.append(fd)
        if len(calls) == step:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(log.os, "dup2", interrupted)
    with pytest.raises(KeyboardInterrupt), log.capture_stderr_fd():
        pass
    monkeypatch.undo()
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert _fds() == fds


def test_threads_compiling_regexes_leave_the_warning_filters_as_they_were() -> None:
    # Each saved and restored the process's filters: interleaved, one restore kept another's
    # "error" filter for good, and any FutureWarning anywhere raised from then on.
    filters = list(warnings.filters)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    stop = threading.Event()

    def compile_regexes(k: int) -> None:
        for i in range(10_000):
            if stop.is_set():
                return
            lcgen.make_plan(regex=f"[a-z]{{{1 + i % 40}}}-{k}")

    workers = [threading.Thread(target=compile_regexes, args=(k,)) for k in range(4)]
    try:
        for worker in workers:
            worker.start()
        stop.wait(2)
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        sys.setswitchinterval(interval)
    assert warnings.filters == filters
    with pytest.raises(lcgen.GrammarError, match="nested set"):  # still refused, each time
        lcgen.make_plan(regex="[[a]")
    with pytest.raises(lcgen.GrammarError, match="nested set"):
        lcgen.make_plan(regex="[[a]")


def test_a_decode_interrupted_before_its_count_began_is_not_counted() -> None:
    # Ctrl-C between the count and the try that undid it left 2 threads counted for good:
    # every later decode's CPU share was read as fewer cores than it had.
    overlaps = threads_module.Overlaps()
    span = threads_module.Span(2)
    assert overlaps.end(span) == 0.0  # never started: nothing to take out
    overlaps.start(span)
    overlaps.end(span)
    assert overlaps._threads == 0 and overlaps.end(span) == 0.0  # (ended once)


def test_a_daemon_thread_generating_at_exit_exits_quietly(model_path: Path) -> None:
    # Python's exit ran the sequences' finalizers while a daemon thread still generated on
    # one: it died with a ClosedError traceback, in a program that closed nothing.
    program = textwrap.dedent(f"""
        import atexit, threading, time
        atexit.register(lambda: time.sleep(1.0))  # the program's own shutdown work
        import lcgen
        m = lcgen.load({str(model_path)!r}, n_ctx=1024, n_threads=1)
        no_end = {{t: float("-inf") for t in range(m.n_vocab) if m.is_eog(t)}}
        run = lambda: m.generate("Write a story:", max_tokens=900, logit_bias=no_end)
        threading.Thread(target=run, daemon=True).start()
        time.sleep(1.0)
        print("exiting")
    """)
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
