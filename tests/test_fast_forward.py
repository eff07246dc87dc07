"""Fast-forward: where a constraint allows only one text next, the tokens the tokenizer writes
for it are appended without sampling and decoded with the next step's batch.

What holds: the forced text is the only text the grammar allows there, so every output still
matches its constraint; the forced tokens are the tokenizer's own for that text (the last one is
left to sampling where the grammar allows a longer token starting with its text: what follows
may join it into that one). What can differ from a run without it: the model then conditions
on the tokenizer's split of the forced text rather than the one it would have sampled, and its
logits come from batches of other sizes (llama.cpp's move by about 0.1 with the batch size).
On the flexible prompt here the text is the same; on the compact one the two part at a near tie
(measured: the age's second digit, top two logits 0.2 apart), so only the keys are compared.
Decode counts prove that forced tokens are decoded once and never sampled.
"""

from __future__ import annotations

import json

import pytest

import lcgen
from lcgen.decoding.generator import Generator
from lcgen.vocab import Vocab

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        # Bounded: greedy decoding can repeat the two tags until max_tokens (it did on an AVX2
        # CPU, whose logits differ in the last bits from an AVX-512 one's).
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
}
ASK = "Give a JSON record for Alice, 31, from Paris, tagged alpha. JSON Schema: " + json.dumps(
    SCHEMA
)
FLEXIBLE = lcgen.Grammar.from_json_schema(SCHEMA)
COMPACT = lcgen.Grammar.from_json_schema(SCHEMA, whitespace="compact")
LONG_CHOICE = ["The quick brown fox jumps over the lazy dog", "No"]


def prompt(model: lcgen.Model, content: str = ASK) -> list[int]:
    return model.chat_tokens([{"role": "user", "content": content}])


def generate(model: lcgen.Model, tokens: list[int], **options: object) -> lcgen.Text:
    with model.sequence(tokens) as seq:
        out: lcgen.Text = seq.generate(**options)  # type: ignore[call-overload]
    return out


def test_forced_text_follows_the_only_characters_allowed(model: lcgen.Model) -> None:
    with COMPACT.state(model) as state:
        assert state.forced_text(64) == '{"name":"'
        assert state.forced_text(3) == '{"n'
        state.accept_tokens(model.tokenize('{"name":"Bob', add_bos=False))
        assert state.forced_text(64) == ""  # inside a string: any character
        state.accept_tokens(model.tokenize('"', add_bos=False))
        assert state.forced_text(64) == ',"age":'
        assert state.accepts_text(',"age":7,"city":"x","tags":[]}')  # the probe changed nothing
    with FLEXIBLE.state(model) as state:
        assert state.forced_text(64) == "{"  # then whitespace or a quote: a choice
    with lcgen.Grammar.choice(["alpha", "beta"]).state(model) as state:
        state.accept_tokens(model.tokenize("a", add_bos=False))
        assert state.forced_text(64) == "lpha"  # where it can end, forcing stops
        state.accept_tokens(model.tokenize("lpha", add_bos=False))
        assert state.is_complete and state.forced_text(64) == ""


def test_forced_text_follows_a_prefix_tree(model: lcgen.Model) -> None:
    # A choice or an enum is a prefix tree: the shared prefix is forced, then after the first
    # character that tells the options apart the rest of the option.
    choice = lcgen.Grammar.choice(["category-alpha", "category-beta", "category-b"])
    enum = lcgen.Grammar.from_json_schema({"enum": ["category-alpha", "category-beta"]})
    with choice.state(model) as state, enum.state(model) as in_json:
        assert state.forced_text(64) == "category-"
        assert in_json.forced_text(64) == '"category-'
        state.accept_tokens(model.tokenize("category-a", add_bos=False))
        in_json.accept_tokens(model.tokenize('"category-a', add_bos=False))
        assert state.forced_text(64) == "lpha" and in_json.forced_text(64) == 'lpha"'
    with choice.state(model) as state:
        state.accept_tokens(model.tokenize("category-b", add_bos=False))
        assert state.forced_text(64) == ""  # it can end here


def test_forced_tokens_are_the_tokenizers(model: lcgen.Model) -> None:
    gen = Generator(model, grammar=COMPACT)
    forced = gen.forced_tokens(b"\n", 16)
    written = model.tokenize('\n{"name":"', add_bos=False)  # as it reads after the prompt
    assert model.token_piece(written[0]) == b"\n"
    assert forced == written[1:] and len(forced) >= 2  # '":"': no longer token can follow
    assert gen.forced_tokens(b"\n", 1) == forced[:1]
    assert gen.tokens == []  # asking changes nothing
    # After a piece the tokenizer would join to the text, the text is tokenized on its own.
    joined = model.tokenize('{"name":"', add_bos=False)
    assert len(model.token_piece(joined[0])) > 1  # '{"' is one token
    gen.accept(model.tokenize("{", add_bos=False)[0])
    assert gen.forced_tokens(b"{", 16) == model.tokenize('"name":"', add_bos=False)
    name = model.tokenize("name", add_bos=False)[0]
    assert name in forced
    for barred in ({"logit_bias": {name: float("-inf")}}, {"stop_tokens": [name]}):
        cut = Generator(model, grammar=COMPACT, **barred).forced_tokens(b"\n", 16)
        assert cut == forced[: forced.index(name)]  # never forced: left to sampling
    healing = Generator(model, grammar=COMPACT, heal=b"{")
    assert healing.forced_tokens(b"\n", 16) == []  # healed text is re-created by sampling


def test_the_last_token_is_left_where_a_longer_one_may_follow(model: lcgen.Model) -> None:
    (name,) = model.tokenize("name", add_bos=False)
    longer = [model.token_piece(t) for t in model.vocab.tokens_starting_with(b"name")]
    assert b"names" in longer  # a token the text after "name" could join it into
    letters = Generator(model, grammar=lcgen.Grammar('root ::= "name" [a-z]+\n'))
    assert letters.forced_tokens(b"\n", 16) == []  # left to sampling: "names" may come
    assert not any(p[4:5].isdigit() for p in longer)  # no token joins "name" to a digit
    digits = Generator(model, grammar=lcgen.Grammar('root ::= "name" [0-9]+\n'))
    assert digits.forced_tokens(b"\n", 16) == [name]


def test_tokens_starting_with_a_text_are_those_of_the_vocabulary(model: lcgen.Model) -> None:
    vocab = model.vocab
    pieces = vocab.all_pieces()
    kept = [
        t for t, p in enumerate(pieces) if p and not vocab.is_special(t) and not vocab.is_eog(t)
    ]
    for prefix in (b"", b"name", b'":', b" ", b"\xc3", b"\xff", b"zzzzqq"):
        expected = [t for t in kept if pieces[t].startswith(prefix)]
        assert vocab.tokens_starting_with(prefix).tolist() == expected, prefix
        expected = [t for t in kept if pieces[t].startswith(prefix) or prefix.startswith(pieces[t])]
        assert vocab.tokens_extending(prefix).tolist() == expected, prefix


def test_all_pieces_are_each_tokens_piece_fetched_once(model: lcgen.Model) -> None:
    vocab = Vocab(model.vocab.handle)  # nothing fetched yet
    some = [vocab.special_piece(t) for t in (0, 17, 1000)]  # a few fetched one by one first
    pieces = vocab.all_pieces()
    assert vocab.all_pieces() is pieces  # later calls (every fast-forward step) fetch nothing
    assert [pieces[t] for t in (0, 17, 1000)] == some
    assert pieces == [model.vocab.handle.token_to_piece(t) for t in range(model.n_vocab)]


def test_text_forced_at_the_start_is_decoded_with_the_prompt(model: lcgen.Model) -> None:
    tokens = prompt(model)
    with model.sequence(tokens) as seq:
        run = seq.run(grammar=COMPACT, max_tokens=120)
        forced = seq.tokens[len(tokens) :]  # appended before any step
        assert forced == model.tokenize('\n{"name":"', add_bos=False)[1:]
        assert run.generator.tokens == forced and seq.n_decoded < len(tokens)
        first = run.step()
        assert first.tokens[: len(forced)] == tuple(forced) and len(first.tokens) > len(forced)
        assert first.text.startswith('{"name')
    with model.sequence(tokens) as seq:
        seq.run(grammar=COMPACT, max_tokens=120, stop=["Paris"])  # a stop string could end it
        assert seq.n_tokens == len(tokens)  # so the first token is sampled


@pytest.mark.parametrize("grammar", [FLEXIBLE, COMPACT], ids=["flexible", "compact"])
def test_same_json_fewer_steps_each_token_decoded_once(
    model: lcgen.Model, grammar: lcgen.Grammar
) -> None:
    tokens = prompt(model)
    plain = generate(model, tokens, grammar=grammar, fast_forward=False, max_tokens=120)
    model.cache.clear()  # the prompt decoded again: the counts below start from nothing
    fast = generate(model, tokens, grammar=grammar, max_tokens=120)
    assert fast.finish_reason == plain.finish_reason == "stop"
    assert list(json.loads(fast)) == list(json.loads(plain)) == list(SCHEMA["properties"])
    if grammar is FLEXIBLE:
        assert fast == plain
    assert plain.stats.forced == 0 and plain.stats.steps == plain.stats.tokens
    stats = fast.stats
    assert stats.forced >= 4 and stats.steps == stats.tokens - stats.forced
    # The prompt and every generated token but the last decoded once; nothing again.
    assert stats.decoded == len(tokens) + stats.tokens - 1 and stats.redecoded == 0


def test_a_stream_joins_to_the_text(model: lcgen.Model) -> None:
    tokens = prompt(model)
    with model.sequence(tokens) as seq:
        chunks = list(seq.stream(grammar=COMPACT, max_tokens=120))
    joined = "".join(c.text for c in chunks)
    assert joined == model.detokenize([t for c in chunks for t in c.tokens])
    # From nothing, as the stream was (a cached prompt's logits can differ in the last bits).
    model.cache.clear()
    assert joined == generate(model, tokens, grammar=COMPACT, max_tokens=120)
    stats = chunks[-1].stats
    assert stats is not None and stats.tokens == sum(len(c.tokens) for c in chunks)
    assert len(chunks) == stats.steps < stats.tokens  # one chunk per step
    assert len(chunks[0].tokens) > 1  # '{"name' forced before the first step: one chunk


def test_the_rest_of_a_chosen_option_is_forced(model: lcgen.Model) -> None:
    tokens = prompt(model, "Say the sentence about the fox.")
    out = generate(model, tokens, choice=LONG_CHOICE, max_tokens=30)
    assert out in LONG_CHOICE
    if out == LONG_CHOICE[0]:  # measured: the model picks it
        assert out.stats.steps <= 2 < out.stats.forced


def test_max_tokens_cuts_forced_text(model: lcgen.Model) -> None:
    tokens = prompt(model)
    with model.sequence(tokens) as seq:
        chunks = list(seq.stream(grammar=COMPACT, max_tokens=3))
    assert sum(len(c.tokens) for c in chunks) == 3 and chunks[-1].finish_reason == "length"
    with model.sequence(tokens) as seq, pytest.raises(lcgen.IncompleteOutputError) as info:
        seq.generate(grammar=COMPACT, max_tokens=3)
    assert '{"name":"'.startswith(info.value.text)


def test_a_stop_string_inside_forced_text_ends_it(model: lcgen.Model) -> None:
    tokens = prompt(model, "Say the sentence about the fox.")
    with model.sequence(tokens) as seq:
        chunks = list(seq.stream(choice=LONG_CHOICE, stop=["brown"], max_tokens=30))
    last = chunks[-1]
    text = "".join(c.text for c in chunks)
    assert (last.finish_reason, last.stop, text) == ("stop", "brown", "The quick ")


def test_with_speculation_the_counts_add_up(model: lcgen.Model) -> None:
    tokens = prompt(model)
    fast = generate(model, tokens, grammar=FLEXIBLE, max_tokens=120)
    model.cache.clear()
    both = generate(model, tokens, grammar=FLEXIBLE, max_tokens=120, speculate="ngram")
    assert both == fast
    s = both.stats
    assert s.forced > 0 and s.tokens == s.steps + s.accepted + s.forced
    assert s.decoded == len(tokens) + s.tokens - 1 + s.drafted - s.accepted


def test_a_batch_fast_forwards_each_element(model: lcgen.Model) -> None:
    asks = [ASK, ASK.replace("Alice, 31, from Paris", "Bob, 45, from Rome")]
    prompts = [model.detokenize(prompt(model, a), special=True) for a in asks]
    batch = model.generate(prompts, grammar=COMPACT, max_tokens=120)
    names = []
    for text in batch:  # (batch shapes can flip near-ties, so no equality with lone runs)
        stats = text.stats
        assert stats.forced > 0 and stats.steps == stats.tokens - stats.forced
        names.append(json.loads(text)["name"])
    assert names == ["Alice", "Bob"]


def test_a_rewind_across_forced_tokens_regenerates_the_same(model: lcgen.Model) -> None:
    with model.sequence(prompt(model)) as seq:
        run = seq.run(grammar=COMPACT, max_tokens=120)
        chunks, checkpoint = [], None
        while not run.is_done:
            chunks.append(run.step())
            if checkpoint is None and len(chunks) > 2 and seq.n_tokens - seq.n_decoded > 1:
                checkpoint, at = run.checkpoint(), len(chunks)  # forced tokens still pending
        assert checkpoint is not None
        run.rewind(checkpoint)
        again = chunks[:at]
        while not run.is_done:
            again.append(run.step())
        assert [c.text for c in again] == [c.text for c in chunks]
        assert [c.tokens for c in again] == [c.tokens for c in chunks]


def test_runs_that_see_every_token_sample_every_token(model: lcgen.Model) -> None:
    tokens = prompt(model)
    plain = generate(model, tokens, grammar=COMPACT, max_tokens=120, fast_forward=False)
    with_logprobs = generate(model, tokens, grammar=COMPACT, max_tokens=120, logprobs=1)
    hooked = generate(model, tokens, grammar=COMPACT, max_tokens=120, hooks=[lambda s: None])
    for out in (with_logprobs, hooked):  # as with fast-forward off, token for token
        assert out == plain and out.tokens == plain.tokens
        assert out.stats.forced == 0 and out.stats.steps == out.stats.tokens
    assert with_logprobs.logprobs is not None
    assert len(with_logprobs.logprobs) == len(with_logprobs.tokens)


def test_the_option_is_checked(model: lcgen.Model) -> None:
    with pytest.raises(TypeError, match="fast_forward must be True or False, got 'yes'"):
        model.generate("x", fast_forward="yes")  # type: ignore[call-overload]


def test_a_token_that_does_not_continue_the_healed_text_leaves_the_generator_as_it_was(
    model: lcgen.Model,
) -> None:
    """The grammar took the token before the healed text refused it: the token healing asked
    for was then refused by the grammar."""
    (a,) = model.tokenize("a", add_bos=False)
    (x,) = model.tokenize("x", add_bos=False)
    gen = Generator(model, choice=["ab", "xy"], max_tokens=5, heal=b"a")
    with pytest.raises(ValueError, match="does not continue the healed text b'a'"):
        gen.accept(x)
    assert gen.tokens == [] and gen.heal == b"a"
    assert gen.accept(a).text == ""  # the healed text, re-created
    assert gen.accept(model.tokenize("b", add_bos=False)[0]).finish_reason == "stop"


def _to_the_end(run: lcgen.PlainRun | lcgen.Backtracker) -> str:
    text = ""
    while not run.is_done:
        text += run.step().text
    return text


def test_a_rewind_to_before_the_first_step_gives_the_forced_opening_again(
    model: lcgen.Model,
) -> None:
    """The text forced before the first step comes with the first step's chunk: rewound to
    a checkpoint taken before it, the chunks lost it (' small' for ' Paris is small')."""
    name = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    for options in (
        {"choice": [" Paris is big", " Paris is small"]},
        {"schema": name, "json_whitespace": "compact", "max_tokens": 30},
    ):
        with model.sequence("Q:") as seq:
            run = seq.run(**options)  # type: ignore[arg-type]
            before = run.checkpoint()
            first = _to_the_end(run)
            run.rewind(before)
            again = _to_the_end(run)
            assert again == first == model.detokenize(run.generator.tokens)
            assert first.startswith((" Paris is ", '{"name":"'))


TAGGED = {
    "type": "object",
    "properties": {
        "kind": {"const": "record"},
        "tags": {
            "type": "array",
            "items": {"enum": ["alpha-one", "alpha-two", "beta"]},
            "uniqueItems": True,
        },
        "count": {"type": "integer"},
    },
    "required": ["kind", "tags", "count"],
    "additionalProperties": False,
}
REPEATED_TAGS = (
    '{"kind":"record","tags":["beta","beta","beta","beta"],"count":4}\nThe same JSON again:'
)


def test_with_unique_items_the_text_outside_them_is_forced(model: lcgen.Model) -> None:
    """A schema with ``uniqueItems`` backtracks (a repeated item is taken back); the text
    outside the arrays whose items must be unique is forced as in a plain run (it was all
    sampled), the items are sampled, each token with its checkpoint."""
    tokens = prompt(model, REPEATED_TAGS)
    grammar = lcgen.Grammar.from_json_schema(TAGGED, whitespace="compact")
    sampled = generate(model, tokens, grammar=grammar, fast_forward=False, max_tokens=80)
    model.cache.clear()
    out = generate(model, tokens, grammar=grammar, max_tokens=80)
    for text in (sampled, out):
        value = json.loads(text)
        assert sorted(value) == ["count", "kind", "tags"] and value["kind"] == "record"
        assert len(value["tags"]) == len(set(value["tags"])) >= 2, text
    assert sampled.stats.forced == 0
    stats = out.stats
    assert stats.rewinds + stats.resamples > 0  # a repeat was taken back
    with model.sequence(tokens) as seq:
        run = seq.run(grammar=grammar, max_tokens=80)
        assert model.detokenize(run.generator.tokens).startswith('{"kind":"record","tags":')
        forced = run.stats().forced
        while not run.is_done:
            run.step()
            made, n = run.generator.tokens, run.stats().forced - forced
            forced += n
            if n:  # (a step that rewound forces nothing: the last n tokens are the forced)
                before, text = model.detokenize(made[:-n]), model.detokenize(made[-n:])
                items = before.partition("[")[2]
                if "[" in before and "]" not in before and items.strip():
                    assert text.startswith("]"), (before, text)  # never inside an item
        assert forced >= 4
