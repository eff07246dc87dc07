"""The default thread count under load: decoding while another process keeps one core busy.

lcgen's default thread count is the cores this process may really use (its CPU affinity and a
cgroup quota, at most 8); the old default was ``os.cpu_count()`` capped at 8, which
oversubscribes a small machine. Each round starts a process that spins on one core, then decodes
``TOKENS`` greedy tokens after a short prompt (the prompt untimed) on three models loaded with
the default, with 1 thread and with 8 threads (the old default on a machine of 8 or more
CPUs), and stops the spinning process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import lcgen
from bench.harness import Bench, Check, Lazy, Row, RowFactory, at_least
from bench.runners import Sample, Workload

TOKENS = 8
PROMPT = "The history of the lighthouse on the northern cape begins"
SERIES = {"default": None, "1 thread": 1, "8 threads": 8}
# The default should do no worse under load than the oversubscribed old default.
MIN_RATIO_OVER_8 = 1.0


def _load(bench: Bench) -> dict[str, lcgen.Model]:
    path = bench.lcgen.model.path
    return {
        name: lcgen.load(path, n_ctx=256, n_threads=n_threads, cache=False)
        for name, n_threads in SERIES.items()
    }


def _close(models: dict[str, lcgen.Model]) -> None:
    for model in models.values():
        model.close()


def _decode(model: lcgen.Model, bias: dict[int, float]) -> Sample:
    with model.sequence(PROMPT) as seq:
        seq.prefill()
        start = time.perf_counter()
        out = seq.generate(max_tokens=TOKENS, temperature=0.0, logit_bias=bias)
        seconds = time.perf_counter() - start
    return Sample(seconds, len(out.tokens), tuple(out.tokens))


def threads_row(work: Workload) -> Row:
    models = Lazy(_load, _close)
    bias = dict(work.bias)

    def round_(bench: Bench, r: int) -> dict[str, Sample]:
        names = list(SERIES)
        names = names[r % len(names) :] + names[: r % len(names)]
        loaded = models.get(bench)  # before the load starts
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)  # let it take its core
            return {name: _decode(loaded[name], bias) for name in names}
        finally:
            spinner.kill()
            spinner.wait()

    return Row(
        "threads-busy",
        f"greedy tokens / time for {TOKENS} tokens after a short prompt while another process "
        "spins on one core: models loaded with lcgen's default thread count (the cores this "
        f"process may use: {len(os.sched_getaffinity(0))} here), with 1 thread and with 8 (the "
        "old default, os.cpu_count() capped at 8, on a machine of 8 or more CPUs)",
        dict.fromkeys(SERIES, "tokens/s"),
        round_,
        (
            Check("default", "8 threads", at_least(MIN_RATIO_OVER_8)),
            Check("default", "1 thread"),
        ),
        close=models.close,
    )


FACTORIES: dict[str, RowFactory] = {"threads-busy": threads_row}
