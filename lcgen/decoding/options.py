"""Generation options, made into one frozen :class:`Plan` at the edge.

Every generation call takes the same keyword options (:class:`GenerateOptions`).
:func:`make_plan` checks them once and turns them into values: the sampler settings, the stop
strings, the constraint compiled to a :class:`~lcgen.Grammar`, the backtracking settings with
their banned-phrase matcher. The loops below see only the plan. Making a plan allocates nothing
in llama.cpp: grammar states are made per generation.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

from lcgen._numbers import check_bool, plain
from lcgen.constrain import Grammar
from lcgen.decoding.hooks import BannedPhrases, Hook, Validator
from lcgen.decoding.results import SchemaLike, Text, check_complete
from lcgen.decoding.sampling import SamplerConfig
from lcgen.decoding.speculation import MAX_DRAFT, MODEL_DRAFT, NGRAM_DRAFT, Speculation
from lcgen.decoding.text import NO_STOPS, Stops

if TYPE_CHECKING:
    from lcgen.vocab import Vocab

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_RETRIES = 64
DEFAULT_LOOKBACK = 16
MAX_LOGPROBS = 50
_SHOWN_ITEMS = 4  # the items of a long list an error message shows


class GenerateOptions(TypedDict, total=False):
    """Keyword options accepted by every generation call (see :func:`make_plan`)."""

    max_tokens: int | None
    stop: str | Sequence[str] | None
    include_stop: bool
    stop_tokens: Iterable[int] | None
    sampler: SamplerConfig | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repeat_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    repeat_last_n: int | None
    seed: int | None
    logit_bias: Mapping[int, float] | None
    logprobs: int | None
    token_healing: bool
    grammar: Grammar | None
    choice: Sequence[str] | None
    regex: str | None
    json_whitespace: Literal["flexible", "compact"]
    hooks: Sequence[Hook] | None
    validators: Sequence[Validator] | None
    banned: Sequence[str | re.Pattern[str]] | None
    banned_ignore_case: bool
    max_retries: int
    lookback: int
    speculate: Literal["ngram"] | Any | None
    num_draft: int
    fast_forward: bool


@dataclass(frozen=True, slots=True)
class Backtracking:
    """Hooks, validators and banned phrases: what makes a generation rewind and retry.

    Attributes:
        hooks: run on each sampled candidate (see :class:`~lcgen.Step`).
        validators: run on the text after each token.
        banned: the phrases the output must not contain.
        max_retries: the most resamples and rewinds in one generation.
        lookback: the most tokens a hook's or validator's ``Rewind`` can drop.
    """

    hooks: tuple[Hook, ...] = ()
    validators: tuple[Validator, ...] = ()
    banned: BannedPhrases = dataclasses.field(default_factory=lambda: BannedPhrases(()))
    max_retries: int = DEFAULT_MAX_RETRIES
    lookback: int = DEFAULT_LOOKBACK


@dataclass(frozen=True, slots=True)
class Plan:
    """One generation call's options, checked and made into values.

    Attributes:
        max_tokens: the most tokens to generate (finish reason ``"length"``); None: up to
            the end of the context (a sequence makes it the room its context has left).
        sampler: how tokens are drawn.
        stops: stop strings and whether the text ends with the one that was hit.
        stop_tokens: token ids that end generation besides the end-of-generation ones.
        logprobs: None, or the number of most likely alternatives to report per token.
        token_healing: back the prompt off its last token and re-create its text.
        constraint: the grammar the output must match (from grammar, choice, regex or schema).
        schema: the JSON Schema / pydantic model the output is parsed with, when given.
        backtracking: hooks, validators and banned phrases, or None when there are none.
        speculation: how drafts are made (``speculate``), or None: one token per step.
        fast_forward: append the tokens a constraint forces without sampling them (see
            :meth:`~lcgen.decoding.generator.Generator.forced_tokens`); off with ``logprobs``.
            A plan made with both (the continuous API's, for weights) gives a forced token the
            log-probability 0: the constraint left no other.
    """

    max_tokens: int | None = DEFAULT_MAX_TOKENS
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    stops: Stops = NO_STOPS
    stop_tokens: frozenset[int] = frozenset()
    logprobs: int | None = None
    token_healing: bool = False
    constraint: Grammar | None = None
    schema: SchemaLike | None = None
    backtracking: Backtracking | None = None
    speculation: Speculation | None = None
    fast_forward: bool = True

    def with_seed(self, seed: int | None) -> Plan:
        """The same plan sampling with ``seed``."""
        return dataclasses.replace(self, sampler=dataclasses.replace(self.sampler, seed=seed))

    def check_complete(self, text: Text, vocab: Vocab, healed: str = "") -> None:
        """Raise when ``text``, generated with this plan, stopped before it matched the plan's
        constraint (``max_tokens``, a stop string or one of ``stop_tokens`` cut it).
        ``healed``: the prompt's text token healing had it re-create.

        Raises:
            IncompleteOutputError: with the partial text.
        """
        check_complete(text, self.constraint, vocab, self.stop_tokens, healed)


_KEYS = frozenset(GenerateOptions.__annotations__)


def make_plan(*, schema: SchemaLike | None = None, **options: Unpack[GenerateOptions]) -> Plan:
    """Check generation options and make them into a :class:`Plan`.

    Args:
        schema: constrain the output to JSON valid for this JSON Schema dict / pydantic model.
        **options: max_tokens (256; None: to the context's end), stop, include_stop,
            stop_tokens, sampler, temperature (0: greedy), top_k, top_p, min_p, repeat_penalty,
            frequency_penalty, presence_penalty, repeat_last_n, seed, logit_bias,
            logprobs, token_healing, grammar, choice, regex (at most one constraint, schema
            included), json_whitespace ("flexible" or "compact", for schema), hooks,
            validators, banned, banned_ignore_case, max_retries, lookback, speculate
            (``"ngram"``: verify drafts looked up in the sequence's own tokens, several
            tokens per step, the output what it would be without; or a draft
            :class:`lcgen.Model` with the same vocabulary, loaded apart from this one),
            num_draft (the most tokens in one draft: 64 for ``"ngram"``, 8 for a draft
            model), fast_forward (True: where a
            constraint allows only one text next, its tokens are appended without sampling
            and decoded in one batch; runs with hooks, validators, banned phrases or logprobs
            sample every token, and the items of a schema's ``uniqueItems`` arrays are sampled).

    Raises:
        TypeError: an unknown option, or an option of the wrong type (named).
        ValueError: an option is out of range (the value is named).
        GrammarError: the constraint cannot be compiled.
    """
    unknown = options.keys() - _KEYS
    if unknown:
        hints = [
            f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
            for name in sorted(unknown)
            for close in [difflib.get_close_matches(name, sorted(_KEYS), n=1)]
        ]
        raise TypeError(f"unknown generation option {', '.join(hints)}; see lcgen.make_plan")
    max_tokens = options.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is not None:
        max_tokens = _int("max_tokens", max_tokens, low=0)
    logprobs = options.get("logprobs")
    if logprobs is not None:
        logprobs = _int("logprobs", logprobs, low=0, high=MAX_LOGPROBS)
    sampler_config = options.get("sampler")
    if sampler_config is not None and not isinstance(sampler_config, SamplerConfig):
        raise TypeError(
            f"sampler must be an lcgen.SamplerConfig, got {sampler_config!r} (for greedy "
            "decoding give temperature=0)"
        )
    stop = options.get("stop")
    if isinstance(stop, bytes | bytearray):
        raise TypeError(f"stop strings are str, got the bytes {stop!r}: decode them first")
    if stop is not None and not isinstance(stop, str | Iterable):
        raise TypeError(f"stop takes a string or a list of strings, got {shown(stop)}")
    bias = options.get("logit_bias")
    if bias is not None and not isinstance(bias, Mapping):
        raise TypeError(
            "logit_bias takes a mapping of token id to number (e.g. {28: -inf} bans token 28), "
            f"got {shown(bias)}"
        )
    sampler = (options.get("sampler") or SamplerConfig()).with_options(
        temperature=options.get("temperature"),
        top_k=options.get("top_k"),
        top_p=options.get("top_p"),
        min_p=options.get("min_p"),
        repeat_penalty=options.get("repeat_penalty"),
        frequency_penalty=options.get("frequency_penalty"),
        presence_penalty=options.get("presence_penalty"),
        repeat_last_n=options.get("repeat_last_n"),
        seed=options.get("seed"),
        logit_bias=tuple(bias.items()) if bias else None,
    )
    constraint = _constraint(options, schema)
    return Plan(
        max_tokens=max_tokens,
        sampler=sampler,
        stops=Stops(
            (stop,) if isinstance(stop, str) else tuple(stop or ()),
            _bool("include_stop", options.get("include_stop", False)),
        ),
        stop_tokens=_token_ids("stop_tokens", options.get("stop_tokens")),
        logprobs=logprobs,
        token_healing=_bool("token_healing", options.get("token_healing", False)),
        constraint=constraint,
        schema=schema,
        backtracking=_backtracking(options, constraint),
        speculation=_speculation(options),
        # logprobs (0 too) give every token its log-probability: a forced token has none.
        fast_forward=_bool("fast_forward", options.get("fast_forward", True)) and logprobs is None,
    )


def shown(value: object, limit: int = 80) -> str:
    """``value`` for an error message, kept short: a long list or tuple as its type, length and
    first items; anything else as its repr, cut after ``limit`` characters."""
    if isinstance(value, list | tuple) and len(value) > _SHOWN_ITEMS:
        head = ", ".join(f"{item!r:.{limit // _SHOWN_ITEMS}}" for item in value[:_SHOWN_ITEMS])
        return f"a {type(value).__name__} of {len(value)} items [{head}, ...]"
    text = repr(value)
    return text if len(text) <= limit else f"{type(value).__name__} {text[:limit]}..."


def _token_ids(name: str, value: object) -> frozenset[int]:
    """An option that takes a list of token ids (None: none); a lone int is refused with the
    list it stands for, as a lone string is for the options that take strings."""
    if value is None:
        return frozenset()
    if isinstance(value, int) and not isinstance(value, bool):
        raise TypeError(f"{name} takes a list of token ids, got {value!r}: use {name}=[{value!r}]")
    if isinstance(value, str | bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise TypeError(f"{name} takes a list of token ids (int), got {shown(value)}")
    return frozenset(_int(name, t) for t in value)


def _bool(name: str, value: object) -> bool:
    check_bool(name, value)
    return bool(value)


def _int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    value = plain(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return value


def _constraint(options: GenerateOptions, schema: SchemaLike | None) -> Grammar | None:
    """The one constraint given, as a grammar.

    Raises:
        ValueError: more than one constraint was given.
    """
    given = {
        name: value
        for name, value in (
            ("grammar", options.get("grammar")),
            ("choice", options.get("choice")),
            ("regex", options.get("regex")),
            ("schema", schema),
        )
        if value is not None
    }
    if len(given) > 1:
        raise ValueError(f"give at most one of grammar, choice, regex, schema; got {sorted(given)}")
    whitespace = options.get("json_whitespace", "flexible")  # (checked whatever is given)
    if whitespace not in ("flexible", "compact"):
        raise ValueError(f"json_whitespace must be 'flexible' or 'compact', got {whitespace!r}")
    grammar, choice, regex = options.get("grammar"), options.get("choice"), options.get("regex")
    if grammar is not None:
        if isinstance(grammar, str):
            raise TypeError(
                "grammar takes an lcgen.Grammar, got GBNF text: use grammar=lcgen.Grammar(text)"
                " or lcgen.Grammar.from_file(name)"
            )
        if not isinstance(grammar, Grammar):
            raise TypeError(f"grammar must be an lcgen.Grammar, got {type(grammar).__name__}")
        return grammar
    if choice is not None:
        if isinstance(choice, str):
            raise TypeError(f"choice must be a list of strings, got the string {choice!r}")
        return Grammar.choice(list(choice))
    if regex is not None:
        return Grammar.regex(regex)
    if isinstance(schema, Mapping):
        return Grammar.from_json_schema(dict(schema), whitespace=whitespace)
    if isinstance(schema, str | bool):  # JSON Schema text, or the schemas true / false
        return Grammar.from_json_schema(schema, whitespace=whitespace)
    if schema is not None and not isinstance(schema, type):
        raise TypeError(
            "schema takes a JSON Schema (a dict, JSON text, True or False) or a pydantic "
            f"model class, got {type(schema).__name__} {schema!r:.80}"
        )
    if schema is not None:
        return Grammar.from_pydantic(schema, whitespace=whitespace)
    return None


def _sequence_of(options: GenerateOptions, name: str, items: str) -> tuple[Any, ...]:
    """An option that takes a list: refuse a lone str (iterated, it would be its letters)
    or a lone callable."""
    value: Any = options.get(name)
    if value is None:
        return ()
    if isinstance(value, str) or callable(value):
        raise TypeError(f"{name} takes a list of {items}, got {value!r}: use {name}=[{value!r}]")
    if isinstance(value, bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise TypeError(f"{name} takes a list of {items}, got {shown(value)}")
    return tuple(value)


def _backtracking(options: GenerateOptions, constraint: Grammar | None) -> Backtracking | None:
    """The plan's backtracking settings; None where nothing can make it rewind (no hooks,
    validators or banned phrases, and no arrays whose items must be unique)."""
    max_retries = _int("max_retries", options.get("max_retries", DEFAULT_MAX_RETRIES), low=0)
    lookback = _int("lookback", options.get("lookback", DEFAULT_LOOKBACK), low=1)
    banned = BannedPhrases(
        _sequence_of(options, "banned", "phrases"),
        _bool("banned_ignore_case", options.get("banned_ignore_case", False)),
    )
    hooks = _sequence_of(options, "hooks", "callables")
    validators = _sequence_of(options, "validators", "callables")
    for name, fns in (("hooks", hooks), ("validators", validators)):
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"{name} must be callables, got {fn!r}")
    if not (hooks or validators or banned or (constraint and constraint.unique)):
        return None
    return Backtracking(hooks, validators, banned, max_retries, lookback)


def _speculation(options: GenerateOptions) -> Speculation | None:
    method: Any = options.get("speculate")
    given = options.get("num_draft")
    if given is not None:
        given = _int("num_draft", given, low=1, high=MAX_DRAFT)
    if method is None:
        if given is not None:
            raise ValueError(f"num_draft={given} needs speculate ('ngram' or a draft lcgen.Model)")
        return None
    if isinstance(method, str):
        if method != "ngram":
            raise ValueError(
                f"speculate must be 'ngram', a draft lcgen.Model or None, got {method!r}"
            )
        return Speculation("ngram", NGRAM_DRAFT if given is None else given)
    if not (hasattr(method, "vocab") and hasattr(method, "context")):
        raise TypeError(
            f"speculate must be 'ngram', a draft lcgen.Model or None, got {type(method).__name__}"
        )
    return Speculation("model", MODEL_DRAFT if given is None else given, method)
