"""Sampling without a model: greedy with biases, filters, reproducible RNG."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lcgen
from lcgen.decoding.sampling import SamplerConfig, new_rng, sample


@given(
    seed=st.integers(0, 2**32 - 1),
    bias=st.dictionaries(st.integers(0, 99), st.sampled_from([-np.inf, -5.0, -0.1, 0.0, 3.0])),
)
def test_greedy_with_biases_is_the_argmax_of_biased_logits(
    seed: int, bias: dict[int, float]
) -> None:
    logits = np.random.default_rng(seed).normal(size=100).astype(np.float32)
    biased = logits.copy()
    for tok, b in bias.items():
        biased[tok] += b
    if np.isneginf(biased).all():
        return
    cfg = SamplerConfig(logit_bias=bias)
    assert sample(logits, cfg, new_rng(0)) == int(np.argmax(biased))


def test_seeded_sampling_is_reproducible_and_respects_filters() -> None:
    logits = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    cfg = SamplerConfig(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0)
    a = [sample(logits, cfg, rng) for rng in [new_rng(3)] for _ in range(50)]
    b = [sample(logits, cfg, rng) for rng in [new_rng(3)] for _ in range(50)]
    assert a == b
    assert set(a) <= set(np.argsort(-logits)[:5].tolist())
    banned = SamplerConfig(temperature=1.0, top_k=5, logit_bias={int(np.argmax(logits)): -np.inf})
    assert int(np.argmax(logits)) not in {sample(logits, banned, new_rng(s)) for s in range(50)}


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-30])
def test_a_vanishing_temperature_samples_the_argmax(temperature: float) -> None:
    # 1 / 1e-310 overflows: dividing the logits themselves made every probability NaN.
    cfg = SamplerConfig(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(20):
            logits = np.random.default_rng(seed).normal(size=500).astype(np.float32)
            assert sample(logits, cfg, new_rng(seed)) == int(np.argmax(logits))


@pytest.mark.parametrize(
    "cfg",
    [
        SamplerConfig(),
        SamplerConfig(logit_bias={1: 2.0}),
        SamplerConfig(temperature=0.8),
        SamplerConfig(temperature=0.8, top_k=0),
    ],
)
def test_nan_logits_raise_and_all_banned_has_no_candidates(cfg: SamplerConfig) -> None:
    logits = np.random.default_rng(0).normal(size=200).astype(np.float32)
    for spot in (0, 57, 199):
        broken = logits.copy()
        broken[spot] = np.nan
        with pytest.raises(lcgen.DecodeError, match="NaN"):
            sample(broken, cfg, new_rng(0))
    banned = dataclasses.replace(cfg, logit_bias={t: -np.inf for t in range(200)})
    with pytest.raises(lcgen.NoCandidatesError):
        sample(logits, banned, new_rng(0))
    with pytest.raises(lcgen.NoCandidatesError):
        sample(np.full(200, -np.inf, dtype=np.float32), cfg, new_rng(0))


def test_an_infinite_bias_forces_its_tokens_when_sampling() -> None:
    logits = np.random.default_rng(0).normal(size=100).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inf - inf made NaN probabilities
        for bias, expected in (({7: np.inf}, {7}), ({7: np.inf, 9: np.inf}, {7, 9})):
            cfg = SamplerConfig(temperature=0.8, logit_bias=bias)
            assert {sample(logits, cfg, new_rng(s)) for s in range(50)} == expected


def test_a_generation_with_every_token_banned_raises(model: lcgen.Model) -> None:
    # It used to emit token 0 (an end token here) and report finish_reason "stop".
    every = {t: -np.inf for t in range(model.vocab.n_vocab)}
    with pytest.raises(lcgen.NoCandidatesError, match="logit_bias"):
        model.generate("The sky is", max_tokens=4, logit_bias=every)
    gen = lcgen.Generator(model.vocab, max_tokens=4)
    with pytest.raises(lcgen.DecodeError, match="NaN"):
        gen.step(np.full(model.vocab.n_vocab, np.nan, dtype=np.float32))


def test_a_vanishing_temperature_generates_the_greedy_text(model: lcgen.Model) -> None:
    greedy = model.generate("The sky is", max_tokens=12)
    assert model.generate("The sky is", max_tokens=12, temperature=1e-310, seed=3) == greedy


def test_repeat_penalty_lowers_recent_tokens() -> None:
    logits = np.array([2.0, 1.9, -1.0], dtype=np.float32)
    assert sample(logits, SamplerConfig(), new_rng(0)) == 0
    assert sample(logits, SamplerConfig(repeat_penalty=1.5), new_rng(0), recent=[0]) == 1


def test_frequency_and_presence_penalties_follow_llama_cpp() -> None:
    from lcgen.decoding.sampling import _adjusted_logits

    logits = np.array([3.0, 2.5, 2.0, -1.0], dtype=np.float32)
    cfg = SamplerConfig(repeat_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    out = _adjusted_logits(logits, cfg, recent=[0, 0, 0, 3, 1])
    # repeat first (divide positive, multiply negative), then count * frequency + presence
    expected = [3.0 / 2 - 3 * 0.25 - 0.5, 2.5 / 2 - 0.25 - 0.5, 2.0, -1.0 * 2 - 0.25 - 0.5]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert cfg.penalizes and not SamplerConfig().penalizes
    assert not SamplerConfig(presence_penalty=1.0, repeat_last_n=0).penalizes
    # greedy: the penalized token loses; a negative presence penalty favours what came before
    assert sample(logits, SamplerConfig(frequency_penalty=0.3), new_rng(0), recent=[0] * 2) == 1
    assert sample(logits, SamplerConfig(presence_penalty=-1.5), new_rng(0), recent=[2]) == 2
    assert sample(logits, SamplerConfig(presence_penalty=1.0), new_rng(0), recent=[]) == 0


@given(
    repeat=st.sampled_from([5e-324, 1e-46, 1e-30, 0.5, 2.0, 1e30, 1e300, 1.7e308]),
    frequency=st.sampled_from([0.0, 2.0, -2.0, 1e308, -1e308]),
    presence=st.sampled_from([0.0, 1.0, 1e38, -1e38, 1e308, -1e308]),
    temperature=st.sampled_from([0.0, 0.7, 1e-310]),
)
def test_extreme_penalties_give_their_limit_not_nan(
    repeat: float, frequency: float, presence: float, temperature: float
) -> None:
    # Penalties beyond float32's range (a repeat penalty that rounds to 0 divides by it) used
    # to make the logits inf - inf = NaN: DecodeError, a 500 from the server.
    from lcgen.decoding.sampling import _adjusted_logits

    logits = np.array([3.0, 2.5, 0.0, -1.0, 1.0, -np.inf], dtype=np.float32)  # 5: banned
    cfg = SamplerConfig(
        temperature=temperature,
        repeat_penalty=repeat,
        frequency_penalty=frequency,
        presence_penalty=presence,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _adjusted_logits(logits, cfg, recent=[0, 0, 2, 3, 5])
        token = sample(logits, cfg, new_rng(0), recent=[0, 0, 2, 3, 5])
    assert not np.isnan(out).any() and out[5] == -np.inf and 0 <= token < 5
    if repeat < 1e-45 and abs(frequency) + abs(presence) < 1e30:
        assert token == 0  # a vanishing penalty: the repeated positive logit is the largest


def test_an_infinite_repeat_penalty_is_refused() -> None:
    with pytest.raises(ValueError, match="repeat_penalty must be > 0 and finite"):
        SamplerConfig(repeat_penalty=float("inf"))


def test_an_infinite_temperature_is_refused() -> None:
    """At temperature inf every logit became NaN: the sampler picked a banned token, 2000
    draws in 2000."""
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite, got inf"):
        SamplerConfig(temperature=float("inf"), logit_bias={5: -np.inf})
    with pytest.raises(ValueError, match="Resample temperature must be >= 0 and finite"):
        lcgen.Resample(temperature=float("inf"))


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_top_p_keeps_the_nucleus(temperature: float) -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    cfg = SamplerConfig(temperature=temperature, top_k=0, top_p=0.8, min_p=0.0)
    assert {sample(logits, cfg, new_rng(s)) for s in range(200)} == {0, 1}


def test_penalties_in_a_real_generation_follow_the_recent_tokens(model: lcgen.Model) -> None:
    # Every greedy token is the argmax of the raw logits minus the penalties of the last 16
    # tokens (prompt included), computed here on its own; and they change what is generated.
    seen: list[tuple[np.ndarray, int]] = []

    def record(step: lcgen.Step) -> None:
        seen.append((step.logits, step.token))

    options = {"max_tokens": 24, "temperature": 0.0, "repeat_last_n": 16}
    penalties = {"frequency_penalty": 0.7, "presence_penalty": 0.4}
    with model.sequence("one one one one one one") as seq:
        history = list(seq.tokens)
        out = seq.generate(hooks=[record], **options, **penalties)  # type: ignore[arg-type]
    assert len(seen) == len(out.tokens) > 0
    for logits, token in seen:
        ids, counts = np.unique(history[-16:], return_counts=True)
        adjusted = np.array(logits, dtype=np.float32)
        adjusted[ids] -= counts * 0.7 + 0.4
        assert token == int(np.argmax(adjusted))
        history.append(token)
    plain = model.generate("one one one one one one", **options)  # type: ignore[call-overload]
    assert plain.tokens != out.tokens


def test_a_draw_moves_with_the_logits_not_with_their_order() -> None:
    """Two near-equal logits trading places by rounding (another batch shape, other cells)
    change a seeded draw only where it falls within the rounding of an edge: the draw walked
    the tokens by likelihood, so every draw that fell on either of them swapped (53 of 200)."""
    logits = np.random.default_rng(5).normal(size=50).astype(np.float32)
    logits[[3, 8]] = 2.0
    logits[3] += 1e-6
    rounded = logits.copy()
    rounded[[3, 8]] = logits[[8, 3]]  # 8 is now the more likely, by 1e-6
    cfg = SamplerConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0)
    draws = [
        (sample(logits, cfg, new_rng(s)), sample(rounded, cfg, new_rng(s))) for s in range(200)
    ]
    assert {a for a, _ in draws} >= {3, 8}  # both are drawn
    assert all(a == b for a, b in draws)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        SamplerConfig(temperature=0.7, top_k=4, top_p=1.0, min_p=0.0),
        SamplerConfig(temperature=1.3, top_k=0, top_p=0.85, min_p=0.05),
    ],
)
def test_draws_follow_the_filtered_distribution(cfg: SamplerConfig) -> None:
    logits = np.log(np.array([0.05, 0.3, 0.02, 0.25, 0.18, 0.1, 0.07, 0.03], dtype=np.float32))
    rng = new_rng(11)
    n = 20_000
    counts = np.bincount([sample(logits, cfg, rng) for _ in range(n)], minlength=8)
    # the distribution the filters leave, computed here on its own
    order = np.argsort(-logits, kind="stable")
    scaled = np.exp((logits[order] - logits[order[0]]) / cfg.temperature)
    probs = scaled / scaled.sum()
    keep = len(order) if cfg.top_k == 0 else cfg.top_k
    if cfg.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(np.exp(logits[order])), cfg.top_p)) + 1)
    keep = min(
        keep, int(np.count_nonzero(np.exp(logits[order]) >= cfg.min_p * np.exp(logits[order[0]])))
    )
    expected = np.zeros(8)
    expected[order[:keep]] = probs[:keep] / probs[:keep].sum()
    assert np.all(counts[expected == 0] == 0)
    assert np.abs(counts / n - expected).max() < 0.015
