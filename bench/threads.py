"""The default thread count under load: decoding while another process keeps one core busy.

lcgen's default thread count adapts: at most the physical cores this process may use (its CPU
affinity and a cgroup quota, at most 8), fewer while the threads do not get their cores (see
``lcgen.runtime.threads``); the old default was ``os.cpu_count()`` capped at 8, which
oversubscribes a small machine. The models stay loaded over the rounds, so the default's first
round includes finding the count. Each round starts a process that spins on one core, then decodes
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

TOKENS = 32
PROMPT = "The history of the lighthouse on the northern cape begins"
# None: lcgen's default; 0: the default's most threads, fixed.
SERIES = {"default": None, "all cores, fixed": 0, "1 thread": 1, "8 threads": 8}
# Under load the default should do no worse than the oversubscribed old default, and about as
# well as the best fixed count (one thread here).
MIN_RATIO_OVER_8 = 1.0
MIN_RATIO_OVER_1 = 0.8


def _load(bench: Bench) -> dict[str, lcgen.Model]:
    path = bench.lcgen.model.path
    models: dict[str, lcgen.Model] = {}
    for name, n_threads in SERIES.items():
        if n_threads == 0:
            n_threads = models["default"].n_threads
        models[name] = lcgen.load(path, n_ctx=256, n_threads=n_threads, cache=False)
    return models


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
        "spins on one core: models loaded with lcgen's default thread count (adaptive: at most "
        f"the cores this process may use, {len(os.sched_getaffinity(0))} here, fewer while they "
        "are busy), with that most fixed, with 1 thread and with 8 (the old default, "
        "os.cpu_count() capped at 8, on a machine of 8 or more CPUs)",
        dict.fromkeys(SERIES, "tokens/s"),
        round_,
        (
            Check("default", "8 threads", at_least(MIN_RATIO_OVER_8)),
            Check("default", "1 thread", at_least(MIN_RATIO_OVER_1)),
            Check("default", "all cores, fixed"),
        ),
        close=models.close,
    )


FACTORIES: dict[str, RowFactory] = {"threads-busy": threads_row}
