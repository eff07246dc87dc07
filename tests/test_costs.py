"""The decode cost model that decides padding: its prior is the laptop rule, it learns another
machine's shape from decodes, and only a context whose thread count adapts learns at all (a
fixed count keeps batch shapes, and so logits, reproducible)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lcgen
from lcgen.runtime.costs import KEEP, DecodeCosts

# ms by batch size after 400 cached tokens on a 2-core AVX-512 machine (64: tiled)
AVX512 = {1: 8.1, 2: 14.5, 4: 22.4, 8: 38.0, 16: 71.0, 32: 137.0, 64: 254.0}


def learned(curve: dict[int, float], cells: int = 400, repeats: int = 3) -> DecodeCosts:
    costs = DecodeCosts()
    rng = np.random.default_rng(0)
    for _ in range(repeats):
        for n, ms in curve.items():
            costs.observe(n, cells, ms / 1000 * rng.uniform(0.97, 1.03))
    return costs


def ms(costs: DecodeCosts, n: int, cells: int = 400) -> float:
    return float(costs.seconds(n, cells)[0]) * 1000


def test_the_prior_is_the_laptop_rule() -> None:
    """Before any decode: 50 tokens after 1,500 cells row by row as measured there (935 ms
    against 310 padded); 12 tokens do not pay for 52 of padding."""
    costs = DecodeCosts()
    assert ms(costs, 50, 1500) == pytest.approx(50 * (2.8 + 10.9 * 1500 / 1024))
    assert ms(costs, 64, 1500) == pytest.approx(64 * (2.65 + 0.92 * 1500 / 1024))
    assert ms(costs, 50, 1500) > 2.5 * ms(costs, 64, 1500)
    assert ms(costs, 12, 1500) < ms(costs, 64, 1500)


def test_another_machine_s_curve_is_learned_and_turns_the_padding_decision() -> None:
    costs = learned(AVX512)
    for n, want in AVX512.items():
        assert ms(costs, n) == pytest.approx(want, rel=0.08), n
    # the prior pads 50 tokens after 400 cells; this machine's decodes say 50 rows are cheaper
    assert ms(DecodeCosts(), 50) > 1.15 * ms(DecodeCosts(), 64)
    assert ms(costs, 50) < ms(costs, 64)


def test_an_unseen_path_follows_the_machine_s_speed() -> None:
    """Decodes 10 times slower than the prior on one path scale the other path's prior."""
    costs = DecodeCosts()
    for cells in (100, 200, 300):
        costs.observe(1, cells, 10 * float(DecodeCosts().seconds(1, cells)[0]))
    assert ms(costs, 256, 400) == pytest.approx(10 * ms(DecodeCosts(), 256, 400), rel=0.01)


def test_old_decodes_give_way_and_reset_forgets() -> None:
    costs = learned({1: 8.0, 2: 12.0})
    for _ in range(KEEP):  # the machine got twice as slow: the newest decodes are all kept
        costs.observe(1, 400, 0.016)
        costs.observe(2, 400, 0.024)
    assert ms(costs, 1) == pytest.approx(16, rel=0.05)
    assert costs.n_kept == 2 * KEEP
    costs.reset()
    assert costs.n_kept == 0
    assert ms(costs, 50, 1500) == pytest.approx(ms(DecodeCosts(), 50, 1500))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-3, 600), st.integers(-3, 10**6), st.floats(allow_nan=True)),
        max_size=80,
    )
)
def test_any_decodes_give_finite_positive_predictions(
    decodes: list[tuple[int, int, float]],
) -> None:
    costs = DecodeCosts()
    for n, cells, seconds in decodes:
        costs.observe(n, cells, seconds)
    out = costs.seconds(np.arange(1, 600), 1000)
    assert np.isfinite(out).all() and (out > 0).all()


def test_only_an_adapting_thread_count_learns(model_path: Path) -> None:
    with lcgen.load(model_path, n_ctx=512, n_threads=2, cache=False) as fixed:
        fixed.generate("The capital of France is", max_tokens=4)
        assert fixed.context.costs.n_kept == 0  # the prior decides: reproducible shapes
    with lcgen.load(model_path, n_ctx=512, n_gpu_layers=0, cache=False) as adapting:
        assert adapting.adaptive_threads
        adapting.generate("The capital of France is", max_tokens=4)
        assert adapting.context.costs.n_kept == 4  # the prompt, then a token a step


def test_the_context_pads_by_the_costs_it_predicts(
    model: lcgen.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same 50-token suffix after a cached prefix: padded where tiles are predicted cheaper
    (the prior), not where this machine's decodes say rows are."""
    prefix = "Q: What is the capital of France?\nA: Paris.\n\n" * 30
    suffix = " ".join(f"item {i}," for i in range(11)) + "\nA:"
    counts = []
    for costs in (learned(AVX512), DecodeCosts()):
        monkeypatch.setattr(costs, "observe", lambda *_: None)  # as predicted, whatever comes
        monkeypatch.setattr(model.context, "costs", costs)
        model.cache.clear()
        model.generate(prefix, max_tokens=1)
        n_new = len(model.tokenize(prefix + suffix)) - model.cache.cached(
            model.tokenize(prefix + suffix)
        )
        assert 30 < n_new < 64
        padded = model.context.n_padded
        model.generate(prefix + suffix, max_tokens=1)
        counts.append(model.context.n_padded - padded)
    assert counts == [0, 64 - n_new]
