"""Full-vocabulary masks through llguidance (:mod:`lcgen.constrain.llg`) equal llama.cpp's, token
for token: at every step of JSON-Schema-Test-Suite instances and the bundled grammars' texts on
SmolLM2, of JSON on Gemma 3's 262k vocabulary (with its user-defined tokens such as
``<table>``), after partial UTF-8 characters, across clones. Grammars whose masks would differ
(``<token>`` rules, classes negating non-ASCII characters) keep llama.cpp's masks."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lcgen
from bench.constrained import COMPANY, GEMMA_MODEL, ORDER, PERSON
from bench.masks import INSTANCE
from bench.schema_compile import SUITE, suite_groups
from lcgen.constrain import Grammar, GrammarState, llg
from lcgen.constrain import grammar as grammar_module
from lcgen.errors import GrammarError, GrammarTooSlowError
from lcgen.registry import resolve
from tests.helpers import many_words_grammar
from tests.test_grammar import BUNDLED


def _compare(state: GrammarState, where: object) -> bool:
    """Whether llguidance gave the mask here; asserts it equals llama.cpp's, and so does the
    text it forces."""
    fast = state._allowed_by_matcher()
    slow = state._allowed_by_llama()
    if fast is None:
        return False
    forced = state.forced_text(64)
    assert forced == state._forced_by_llama(64, float("inf")), (where, forced)
    differ = np.flatnonzero(fast != slow)
    assert not differ.size, (where, differ[:8].tolist(), int(fast.sum()), int(slow.sum()))
    return True


def walk(grammar: Grammar, model: lcgen.Model, tokens: list[int], where: object) -> int:
    """Compare the masks at each step of ``tokens`` and after the last; the steps llguidance
    gave. Stops where the grammar refuses a token (an invalid text's tail)."""
    by_matcher = 0
    with grammar.state(model) as state:
        for i, token in enumerate(tokens):
            by_matcher += _compare(state, (where, i))
            if not state.try_accept(token):
                return by_matcher
        by_matcher += _compare(state, (where, len(tokens)))
    return by_matcher


def spelled(model: lcgen.Model, text: str) -> list[int]:
    return model.vocab.spell(text.encode("utf-8"))


def test_the_test_suite_masks_the_same(model: lcgen.Model) -> None:
    assert SUITE.is_dir(), f"{SUITE} is missing: run `make test` (it unpacks the suite)"
    steps = by_matcher = 0
    for i, (name, group) in enumerate(suite_groups()):
        if i % 3:  # every third group: the whole suite's masks take minutes through llama.cpp
            continue
        try:
            grammar = Grammar.from_json_schema(group["schema"])
        except GrammarError:
            continue
        for case in group["tests"][:2]:
            tokens = spelled(model, json.dumps(case["data"]))
            by_matcher += walk(grammar, model, tokens, (name, case["description"]))
            steps += len(tokens) + 1
    assert steps > 1500
    assert by_matcher > steps // 2  # llguidance gave most masks (not where text is forced)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_grammars_mask_the_same(model: lcgen.Model, name: str) -> None:
    good, bad = BUNDLED[name]
    grammar = Grammar.bundled(name)
    for text in good + bad:
        walk(grammar, model, spelled(model, text), text)


# Characters of the Basic Multilingual Plane: the model's vocabulary spells each of them.
bmp_text = st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs"]), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | bmp_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(bmp_text, inner, max_size=3),
    max_leaves=6,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values, indent=st.sampled_from([None, 1]))
def test_random_json_masks_the_same(model: lcgen.Model, value: Any, indent: int | None) -> None:
    text = json.dumps(value, ensure_ascii=False, indent=indent)
    walk(Grammar.bundled("json"), model, spelled(model, text), text)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), schema=st.sampled_from([PERSON, ORDER, COMPANY]))
def test_random_walks_with_clones_and_restores_mask_the_same(
    model: lcgen.Model, data: st.DataObject, schema: dict[str, Any]
) -> None:
    # Random operation sequences on a state: accept any token llama.cpp's grammar allows,
    # clone, go back to a clone (as a checkpoint's restore does), compare the masks: a matcher
    # made late, copied, or left behind by a clone stays in step with the tokens accepted.
    grammar = Grammar.from_json_schema(schema)
    eog = model.vocab.eog_set
    state = grammar.state(model)
    saved: list[GrammarState] = []
    ops = st.sampled_from(["accept", "accept", "accept", "mask", "clone", "restore"])
    try:
        for step in range(40):
            op = data.draw(ops)
            if op == "mask":
                _compare(state, step)
            elif op == "clone":
                saved.append(state.clone())
            elif op == "restore" and saved:
                state.close()
                state = saved.pop()
            elif op == "accept":
                mask = np.flatnonzero(state._allowed_by_llama()).tolist()
                allowed = [t for t in mask if t not in eog]
                if not allowed:
                    break
                state.accept(data.draw(st.sampled_from(allowed)))
        _compare(state, "last")
    finally:
        for each in [state, *saved]:
            each.close()


def test_after_a_partial_character_the_masks_agree(model: lcgen.Model) -> None:
    grammar = Grammar.from_json_schema({"type": "string", "maxLength": 4})
    by_byte = model.vocab.byte_tokens
    tokens = spelled(model, '"') + [by_byte[b] for b in "é€".encode()]
    # By llguidance at every step, the first (where the opening quote is forced) too.
    assert walk(grammar, model, tokens, "bytes") == len(tokens) + 1


def test_where_text_is_forced_every_split_of_it_is_masked_through_llguidance(
    model: lcgen.Model,
) -> None:
    # llguidance's own mask holds the forced text's tokenization only: these masks came from
    # llama.cpp, which took seconds a token over a grammar of a few thousand alternatives.
    grammar = Grammar('root ::= " hello" [a-z]+ | " hello" [0-9]')
    with grammar.state(model) as state:
        assert state.forced_text(64) == " hello"
        assert _compare(state, "forced")
        allowed = {model.vocab.piece(int(t)) for t in np.flatnonzero(state.allowed())}
        assert {b" h", b" he", b" hello"} <= allowed and b" help" not in allowed


def test_clones_keep_their_own_matchers(model: lcgen.Model) -> None:
    grammar = Grammar.from_json_schema(COMPANY)
    with grammar.state(model) as state:
        state.accept_tokens(spelled(model, '{"company": "Ac'))
        assert _compare(state, "before")
        with state.clone() as other:
            state.accept_tokens(spelled(model, 'me", "founded": 19'))
            other.accept_tokens(spelled(model, 'ro"'))
            assert _compare(state, "state") and _compare(other, "clone")
            assert not np.array_equal(state.allowed(), other.allowed())


def test_grammars_llguidance_cannot_take_mask_through_llama(model: lcgen.Model) -> None:
    grammar = Grammar('root ::= "a" <[17]>\n')  # a token by id ("!"): no Lark of it
    (a,) = spelled(model, "a")
    with grammar.state(model) as state:
        assert state._allowed_by_matcher() is None
        assert state.allowed()[a]
        state.accept(a)
        assert np.flatnonzero(state.allowed()).tolist() == [17]
    # A class negating a non-ASCII character: llama.cpp checks a partial character more
    # strictly than a whole one there, so its masks are kept.
    with Grammar('root ::= [^é ]+ " " [a-z]+\n').state(model) as state:
        state.accept_tokens(spelled(model, "x"))
        assert state._allowed_by_matcher() is None and state.allowed().any()


def test_a_grammar_nested_deeper_than_the_translation_goes_masks_through_llama(
    model: lcgen.Model,
) -> None:
    # 600 levels of parentheses: llama.cpp takes it (its bound is 1,000), the translation to
    # Lark recurses past Python's limit; the grammar keeps llama.cpp's masks, once decided.
    grammar = Grammar("root ::= " + "(" * 600 + '"a" [b-z]*' + ")" * 600 + "\n")
    assert llg.compile_matcher(grammar.gbnf, grammar.root, model.vocab) is None
    (a,) = spelled(model, "a")
    for _ in range(2):
        with grammar.state(model) as state:
            assert state._allowed_by_matcher() is None
            allowed = state.allowed()
            assert (
                np.flatnonzero(allowed).tolist()
                == np.flatnonzero(state._allowed_by_llama()).tolist()
            )
            assert allowed[a] and allowed.sum() < model.n_vocab
            state.accept(a)
            assert state.allowed()[spelled(model, "b")[0]]
    assert "nests too deeply" in llg._templates[model.vocab][grammar.gbnf, grammar.root]


def test_a_grammar_too_large_for_llguidance_raises_instead_of_masking_for_minutes(
    model: lcgen.Model,
) -> None:
    # 37,000 alternatives: llguidance refuses the grammar, and llama.cpp's check of each of
    # the 8,800 candidates takes about 20 ms (a mask took minutes, a generation hours). The
    # mask stops once its work projects past the bound, and says what it would cost and why.
    grammar = Grammar(many_words_grammar(40_000))
    with grammar.state(model) as state, pytest.raises(GrammarTooSlowError) as raised:
        state.allowed()
    message = str(raised.value)
    # (the cost projected, or found past the bound while the candidates were gathered)
    assert re.search(r"would take (about \d+ s \(\d+ tokens to check at|over \d+ s)", message)
    assert "llguidance refused it" in message
    with pytest.raises(GrammarTooSlowError):
        model.generate("Words:", grammar=grammar, max_tokens=4, temperature=0)


def test_a_rule_of_thousands_of_alternatives_masks_through_llguidance(model: lcgen.Model) -> None:
    # 2,584 words, all open after each comma: past llguidance's default of 2,000 open
    # alternatives it refused the grammar there and llama.cpp masked (1.4 s here).
    text = many_words_grammar(2_600)
    first = text.split("item ::= ")[1].split(" | ")[0].strip('"')
    with Grammar(text).state(model) as state:
        state.accept_tokens(spelled(model, first + ","))
        allowed = state._allowed_by_matcher()
        assert allowed is not None
        by_llama = state._sampler.allowed(state._candidates(deadline=float("inf")))
        assert np.array_equal(allowed, state._keep_valid_text(by_llama))


@pytest.mark.parametrize(
    ("gbnf", "why"),
    [
        ("root ::= " + "(" * 600 + '"a" [b-z]*' + ")" * 600 + "\n", "nests too deeply"),
        ('root ::= [^"é]+\n', "negates a class with non-ASCII characters"),
        ('root ::= "a" [b-z]*\n', "llguidance is not installed"),
    ],
)
def test_a_mask_over_the_bound_says_why_llguidance_has_none(
    model: lcgen.Model, monkeypatch: pytest.MonkeyPatch, gbnf: str, why: str
) -> None:
    grammar = Grammar(gbnf)
    if why.endswith("not installed"):
        monkeypatch.setattr(llg, "_llg", None)
    monkeypatch.setattr(grammar_module, "MAX_MASK_SECONDS", 0.0)
    with grammar.state(model) as state, pytest.raises(GrammarTooSlowError, match=why):
        state.allowed()
    if "negates" not in why:  # (such a grammar forces no text)
        with grammar.state(model) as state, pytest.raises(GrammarTooSlowError, match=why) as e:
            state.forced_text(8)
        # the bound is on the whole walk (it said "about 0 s a character, over 2 s a token")
        assert "following the text this grammar forces would take over" in str(e.value)
    monkeypatch.undo()
    with grammar.state(model) as state:  # within the bound: the mask as ever
        assert state.allowed().any()


def test_threads_sharing_the_compiled_grammars_get_the_same_masks(model: lcgen.Model) -> None:
    # More grammars than are kept (32), from 4 threads at once: compiled grammars are added
    # and cleared while other threads look them up.
    grammars = [Grammar(f'root ::= [a-z]+ "{i}"\n') for i in range(40)]  # nothing forced
    failures: list[object] = []

    def work(offset: int) -> None:
        try:
            for grammar in grammars[offset:] + grammars[:offset]:
                with grammar.state(model) as state:
                    fast = state._allowed_by_matcher()
                    assert fast is not None and np.array_equal(fast, state._allowed_by_llama())
        except Exception as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(10 * i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_without_llguidance_masks_come_from_llama(
    model: lcgen.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    grammar = Grammar.from_json_schema(PERSON)
    with grammar.state(model) as state:
        state.accept_tokens(spelled(model, '{"name": "M'))
        expected = state.allowed()
    monkeypatch.setattr(llg, "_llg", None)
    assert not llg.available()
    with grammar.state(model) as state:
        state.accept_tokens(spelled(model, '{"name": "M'))
        assert state._allowed_by_matcher() is None
        assert np.array_equal(state.allowed(), expected)


@pytest.fixture(scope="module")
def gemma() -> Iterator[lcgen.Model]:
    with lcgen.Model(resolve(GEMMA_MODEL, download=False), n_ctx=256, n_seq_max=1) as m:
        yield m


def test_gemma_masks_the_same(gemma: lcgen.Model) -> None:
    text = json.dumps(INSTANCE, indent=2)
    grammar = Grammar.from_json_schema(COMPANY)
    steps = len(spelled(gemma, text)) + 1
    assert walk(grammar, gemma, spelled(gemma, text), "company") > steps // 2
    order = {"order_id": 7, "customer": "Zoë <table>", "items": [{"sku": "a", "quantity": 2,
             "price": 1.5}], "status": "shipped"}  # fmt: skip
    walk(Grammar.from_json_schema(ORDER), gemma, spelled(gemma, json.dumps(order)), "order")
    table = gemma.tokenize("<table>", add_bos=False)
    assert len(table) == 1  # a user-defined token, matched by its text
    with Grammar.from_json_schema({"type": "string"}).state(gemma) as state:
        state.accept_tokens(spelled(gemma, '"'))
        assert state.allowed()[table[0]] and _compare(state, "user-defined")
