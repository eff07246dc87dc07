"""What to generate, for the continuous API: ``generate.text``, ``choice``, ``json``, ``regex``,
``grammar``.

Each returns a :class:`GenerateSpec`, a frozen value holding the model and the generation
options; :func:`lcgen.continuous.continuous` turns it into a callable that runs on prompts and
on :class:`~lcgen.continuous.SequenceState` values::

    from lcgen import continuous, generate
    text = continuous(generate.text(model, max_tokens=20))
    pick = continuous(generate.choice(model, ["happy", "sad"]))

How a spec runs on the elements of a state, and how they share the model's slots:
:mod:`lcgen.continuous.elements`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Unpack

from lcgen._numbers import MAX_SEQ, plain
from lcgen.constrain import Grammar
from lcgen.decoding import GenerateOptions, Plan, SamplerConfig, make_plan
from lcgen.decoding.results import SchemaLike
from lcgen.runtime.tokens import ModelLike, check_model

# The options that need one sequence to rewind: beam search takes none of them.
_BACKTRACK_OPTIONS = frozenset(
    ("hooks", "validators", "banned", "banned_ignore_case", "max_retries", "lookback")
)

# The largest length_penalty either way: n ** 10 neither overflows nor vanishes for any n a
# context holds.
MAX_LENGTH_PENALTY = 10

__all__ = ["GenerateSpec", "choice", "grammar", "json", "regex", "text"]


@dataclass(frozen=True, slots=True, eq=False)
class GenerateSpec:
    """A generation recipe: the model, the plan every call follows, and beam search settings.

    Attributes:
        model: the model to generate with.
        plan: the generation options made into a plan (see :func:`lcgen.decoding.make_plan`),
            the constraint compiled.
        beams: beam search width, or None to sample (or decode greedily) as the plan says.
        length_penalty: with beams, finished beams are ranked by their summed log-probability
            divided by ``n_generated ** length_penalty`` (0 ranks by the plain sum); a finite
            number in [-10, 10].
    """

    model: ModelLike
    plan: Plan
    beams: int | None = None
    length_penalty: float = 1.0

    def element_plan(self, seed: int | None) -> Plan:
        """The plan for one element's generation: ``seed`` set, log-probabilities on (each
        chunk carries its token's log-probability)."""
        plan = self.plan.with_seed(seed)
        return plan if plan.logprobs is not None else dataclasses.replace(plan, logprobs=0)

    @property
    def bans(self) -> list[int]:
        """The tokens a beam search never takes (``logit_bias`` of -inf)."""
        return [tok for tok, _ in self.plan.sampler.logit_bias]


def _spec(
    model: ModelLike, options: dict[str, Any], beams: int | None, length_penalty: float
) -> GenerateSpec:
    """Check the options now (a bad one raises here, not at the first call) and make them into
    a plan, the constraint compiled once.

    Raises:
        ValueError: an option is out of range, or beam search is combined with sampling.
        GrammarError: the constraint cannot be built.
        TypeError: ``model`` is not a model.
    """
    check_model(model, "a generation spec's first argument is the model (an lcgen.Model)")
    beams, length_penalty = plain(beams), plain(length_penalty)  # type: ignore[assignment]
    _check_length_penalty(length_penalty)
    if beams is not None:
        _check_beams(model, beams, options)
    plan = make_plan(**options)
    model.vocab.check_tokens(plan.stop_tokens)
    model.vocab.check_tokens(tok for tok, _ in plan.sampler.logit_bias)
    return GenerateSpec(model, plan, beams, float(length_penalty))


def _changed(options: Mapping[str, Any], names: Seq[str]) -> dict[str, Any]:
    """The sampler settings among ``names`` given with other than their default values."""
    default = SamplerConfig()
    return {
        name: options[name]
        for name in names
        if options.get(name) not in (None, getattr(default, name))
    }


def _check_length_penalty(length_penalty: object) -> None:
    """A finite number within [-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY] (``n **
    length_penalty`` stays a float above 0 for any length a context holds)."""
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, int | float):
        raise TypeError(f"length_penalty must be a number, got {length_penalty!r:.80}")
    if not -MAX_LENGTH_PENALTY <= length_penalty <= MAX_LENGTH_PENALTY:  # (NaN fails too)
        raise ValueError(
            f"length_penalty must be a finite number in [-{MAX_LENGTH_PENALTY}, "
            f"{MAX_LENGTH_PENALTY}], got {length_penalty!r}"
        )


def _check_beams(model: ModelLike, beams: int, options: Mapping[str, Any]) -> None:
    if isinstance(beams, bool) or not isinstance(beams, int) or beams < 1:
        raise ValueError(f"beams must be an integer >= 1, got {beams!r}")
    n_slots = model.context.n_seq_max
    if beams > n_slots:
        advice = (
            f"load it with n_seq_max >= {beams}"
            if beams <= MAX_SEQ
            else f"a model has {MAX_SEQ} at most: use fewer beams"
        )
        raise ValueError(
            f"beams={beams} needs {beams} live sequences but the model has n_seq_max="
            f"{n_slots} slots: {advice}"
        )
    truncation = _changed(options, ("top_k", "top_p", "min_p"))
    if (options.get("temperature") or 0) > 0 or options.get("sampler") is not None or truncation:
        given = {"temperature": options.get("temperature"), "sampler": options.get("sampler")}
        settings = ", ".join(f"{k}={v!r}" for k, v in {**given, **truncation}.items())
        raise ValueError(
            "beam search ranks tokens by their log-probability: it takes no sampler settings "
            f"({settings})"
        )
    if _BACKTRACK_OPTIONS & options.keys():
        raise ValueError(
            f"beam search does not take {sorted(_BACKTRACK_OPTIONS & options.keys())} (hooks, "
            "validators and banned phrases need one sequence to rewind)"
        )
    penalties = list(_changed(options, ("repeat_penalty", "frequency_penalty", "presence_penalty")))
    if penalties or options.get("token_healing"):
        raise ValueError(
            "beam search supports neither penalties (repeat, frequency, presence) nor "
            f"token_healing; got {penalties or ['token_healing']}"
        )
    if options.get("speculate") is not None:
        raise ValueError(
            f"beam search does not speculate (speculate={options['speculate']!r}): each step "
            "ranks every beam's whole next-token distribution, which a draft cannot stand for"
        )
    bias = options.get("logit_bias")
    if isinstance(bias, Mapping):  # (make_plan refuses anything else)
        others = {tok: b for tok, b in bias.items() if b != float("-inf")}
        if others:
            raise ValueError(
                f"beam search only takes bans (logit_bias of -inf); got other biases {others!r}"
            )


def text(
    model: ModelLike,
    *,
    beams: int | None = None,
    length_penalty: float = 1.0,
    **options: Unpack[GenerateOptions],
) -> GenerateSpec:
    """Free text (or whatever constraint ``options`` hold).

    Args:
        model: the model.
        beams: beam search of this width instead of sampling: the state's sample axis holds
            the finished beams, best first.
        length_penalty: see :class:`GenerateSpec`.
        **options: max_tokens, stop, temperature, seed, ... (see :func:`lcgen.decoding.make_plan`).

    Raises:
        ValueError: an option is out of range (named), or beams with sampler settings.
    """
    return _spec(model, dict(options), beams, length_penalty)


def choice(
    model: ModelLike,
    choices: Seq[str],
    *,
    beams: int | None = None,
    length_penalty: float = 1.0,
    **options: Unpack[GenerateOptions],
) -> GenerateSpec:
    """Exactly one of ``choices``.

    Raises:
        TypeError: ``choices`` is a single string rather than a list of them.
        ValueError: ``choices`` is empty, or an option is out of range.
    """
    if isinstance(choices, str):
        raise TypeError(f"choices must be a list of strings, got the string {choices!r}")
    if not choices:
        raise ValueError("choices must not be empty")
    return _spec(model, {**options, "choice": list(choices)}, beams, length_penalty)


def json(
    model: ModelLike,
    schema: SchemaLike,
    *,
    beams: int | None = None,
    length_penalty: float = 1.0,
    **options: Unpack[GenerateOptions],
) -> GenerateSpec:
    """JSON valid for a JSON Schema dict or a pydantic model class (the state holds its text).

    Raises:
        GrammarError: the schema uses a keyword lcgen cannot enforce (named).
    """
    return _spec(model, {**options, "schema": schema}, beams, length_penalty)


def regex(
    model: ModelLike,
    pattern: str,
    *,
    beams: int | None = None,
    length_penalty: float = 1.0,
    **options: Unpack[GenerateOptions],
) -> GenerateSpec:
    """Text that fully matches the regular expression ``pattern``.

    Raises:
        GrammarError: the pattern uses a feature lcgen's converter does not support.
    """
    return _spec(model, {**options, "regex": pattern}, beams, length_penalty)


def grammar(
    model: ModelLike,
    gbnf: Grammar | str,
    *,
    beams: int | None = None,
    length_penalty: float = 1.0,
    **options: Unpack[GenerateOptions],
) -> GenerateSpec:
    """Text of a GBNF grammar ``gbnf``: a :class:`~lcgen.Grammar`, or GBNF source text.

    Raises:
        GrammarError: the grammar does not parse (llama.cpp's reason and position).
    """
    constraint = Grammar(gbnf) if isinstance(gbnf, str) else gbnf
    return _spec(model, {**options, "grammar": constraint}, beams, length_penalty)
