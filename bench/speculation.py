"""The speculative-decoding rows: drafts looked up in the sequence's own tokens
(``speculate="ngram"``) against the same generation without them, and against
llama-cpp-python's prompt lookup (``Llama(draft_model=LlamaPromptLookupDecoding())``).

- ``speculate-copy``: a chat request to repeat a passage of about 300 tokens, greedy,
  end-of-generation banned (the output copies the passage);
- ``speculate-free``: a chat request for a story, greedy, end-of-generation banned (drafts
  rarely help: the row shows what they cost);
- ``speculate-json``: JSON-Schema-constrained extraction from the same passage, generated until
  the JSON is complete;
- ``speculate-draft``: the story with the bench's model loaded again as its own draft model
  (``speculate=draft_model``): nearly every draft should be accepted, and the output the same.

lcgen is timed from its first chunk to its last (the tokens after the first: the prompt's
decode is not in it); llama-cpp-python as ``create_completion`` of all the tokens minus
``create_completion`` of one, both from an empty cache. Every lcgen sample records its tokens:
the row's token check compares speculative and plain output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

import lcgen
from bench.harness import Bench, Check, Lazy, Row, RowFactory, at_least, interleaved
from bench.runners import LlamaCppPython, Sample, Workload, check_json, load_lcgen

COPY_MIN_RATIO = 2.0
FREE_MIN_RATIO = 0.97
LOOKUP_MIN_RATIO = 1.3
JSON_MIN_RATIO = 1.5
JSON_MAX_TOKENS = 384

PASSAGE = (
    "Every evening at dusk, Tomas Brenner climbed the one hundred and twelve steps of the "
    "Skerry Point lighthouse. He carried a brass lamp, a leather notebook and a flask of black "
    "tea. At the top he wiped the great lens with a soft cloth, wound the clockwork that turned "
    "it, and lit the wick. Then he wrote the weather in his notebook: the wind, the state of "
    "the sea, the cloud, and the names of the ships that passed. In the winter of 1911 a storm "
    "broke three panes of the lantern room, and he kept the light burning for four nights with "
    "sailcloth nailed over the gaps. The harbour master of Caldwick sent him a letter of thanks "
    "and a barrel of apples. In forty-one years he missed only one evening, the night his "
    "daughter Elsa was born in the village below; his brother Anton climbed the steps for him. "
    "When the light was finally electrified in 1953, Tomas gave his notebooks to the village "
    "school, where the children still read them aloud on the longest night of the year. The "
    "notebooks record more than nine thousand ships, two hundred and six storms and one whale, "
    "which he drew in the margin beside the entry for the eleventh of March, 1927. The last "
    "entry, written in a careful hand, says only: calm sea, clear sky, the light is in good "
    "hands."
)
EXTRACT = {
    "type": "object",
    "properties": {
        "keeper": {"type": "string", "maxLength": 60},
        "lighthouse": {"type": "string", "maxLength": 60},
        "steps": {"type": "integer"},
        "items_carried": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "maxItems": 4,
        },
        "storm_year": {"type": "integer"},
        "last_entry": {"type": "string", "maxLength": 200},
    },
    "required": ["keeper", "lighthouse", "steps", "items_carried", "storm_year", "last_entry"],
    "additionalProperties": False,
}


def _chat(model: lcgen.Model, content: str) -> tuple[int, ...]:
    return tuple(model.chat_tokens([{"role": "user", "content": content}]))


def copy_prompt(model: lcgen.Model) -> tuple[int, ...]:
    return _chat(model, f"Repeat the following text exactly, word for word:\n\n{PASSAGE}")


def free_prompt(model: lcgen.Model) -> tuple[int, ...]:
    return _chat(model, "Write a long story about a fox who learns to sail.")


def json_prompt(model: lcgen.Model) -> tuple[int, ...]:
    return _chat(
        model,
        f"{PASSAGE}\n\nExtract from this text, as JSON: the keeper's name, the lighthouse, "
        "the number of steps, the items he carried, the year of the storm, and the last "
        f"entry of his notebook word for word.\nJSON Schema: {json.dumps(EXTRACT)}",
    )


def lcgen_after_first(
    bench: Bench,
    prompt_of: Callable[[lcgen.Model], tuple[int, ...]],
    max_tokens: int,
    **options: Any,
) -> Sample:
    """The bench's lcgen run of the prompt (see :meth:`bench.runners.Lcgen.after_first`); a
    constrained run that ended with its grammar complete must have made JSON."""
    sample, text, finish = bench.lcgen.after_first(
        prompt_of(bench.lcgen.model), max_tokens, **options
    )
    if options.get("grammar") is not None:
        check_json(text, finish, "lcgen's constrained extraction")
    return sample


def _lookup(prompt_of: Callable[[lcgen.Model], tuple[int, ...]]) -> Lazy[LlamaCppPython]:
    """llama-cpp-python with its prompt-lookup draft model, loaded on first use (and warmed
    up on the row's prompt)."""

    def make(bench: Bench) -> LlamaCppPython:
        side = LlamaCppPython(
            bench.lcgen.model.path,
            bench.llama_cpp_python.cfg,
            logits_all=True,  # its draft path needs it (else it fails to store scores)
            draft_model=LlamaPromptLookupDecoding(),
        )
        # Its first completion faults in the pages of its logits array (n_ctx rows of the
        # vocabulary): untimed here, or the 1-token run it subtracts (see after_first) could
        # take longer than the whole one (a quick run, one round, measured below zero).
        side.complete(prompt_of(bench.lcgen.model), 1)
        return side

    return Lazy(make, LlamaCppPython.close)


def _measures(
    prompt_of: Callable[[lcgen.Model], tuple[int, ...]],
    n_tokens: Callable[[Workload], int],
    *,
    lookup: Lazy[LlamaCppPython] | None = None,
    grammar: lcgen.Grammar | None = None,
) -> dict[str, Callable[[Bench], Sample]]:
    def options(bench: Bench) -> dict[str, Any]:
        if grammar is not None:
            return {"grammar": grammar}
        return {"bias": bench.work.bias}

    def ours(speculate: str | None) -> Callable[[Bench], Sample]:
        def measure(bench: Bench) -> Sample:
            n = n_tokens(bench.work)
            return lcgen_after_first(bench, prompt_of, n, speculate=speculate, **options(bench))

        return measure

    measures = {"lcgen, ngram": ours("ngram"), "lcgen": ours(None)}
    if lookup is not None:

        def theirs(side_of: Callable[[Bench], LlamaCppPython]) -> Callable[[Bench], Sample]:
            def measure(bench: Bench) -> Sample:
                side = side_of(bench)
                sample = side.after_first(
                    prompt_of(bench.lcgen.model), n_tokens(bench.work), bias=bench.work.bias
                )
                return Sample(sample.seconds, sample.count)  # its tokens: not compared

            return measure

        measures["llama-cpp-python, prompt lookup"] = theirs(lookup.get)
        measures["llama-cpp-python"] = theirs(lambda b: b.llama_cpp_python)
    return measures


def _units(names: Mapping[str, Any]) -> dict[str, str]:
    return dict.fromkeys(names, "tokens/s")


def copy_row(work: Workload) -> Row:
    lookup = _lookup(copy_prompt)
    measures = _measures(copy_prompt, lambda w: w.n_tokens + 1, lookup=lookup)
    return Row(
        "speculate-copy",
        f"a chat request to repeat a passage of about 300 tokens, {work.n_tokens + 1} greedy "
        "tokens (end-of-generation banned), tokens/s after the first: lcgen's seq.stream with "
        "speculate='ngram' and without; llama-cpp-python's create_completion with "
        "draft_model=LlamaPromptLookupDecoding() (its defaults: 2-grams, 10 tokens) and "
        "without, each as the completion minus a 1-token completion",
        _units(measures),
        interleaved(measures),
        (
            Check("lcgen, ngram", "lcgen", at_least(COPY_MIN_RATIO)),
            Check("lcgen, ngram", "llama-cpp-python, prompt lookup", at_least(LOOKUP_MIN_RATIO)),
            Check("llama-cpp-python, prompt lookup", "llama-cpp-python"),
        ),
        close=lookup.close,
    )


def free_row(work: Workload) -> Row:
    measures = _measures(free_prompt, lambda w: w.n_tokens + 1)
    return Row(
        "speculate-free",
        f"a chat request for a story, {work.n_tokens + 1} greedy tokens (end-of-generation "
        "banned), tokens/s after the first: lcgen's seq.stream with speculate='ngram' and "
        "without (drafts rarely match: what they cost when they do not help)",
        _units(measures),
        interleaved(measures),
        (Check("lcgen, ngram", "lcgen", at_least(FREE_MIN_RATIO)),),
    )


def json_row(work: Workload) -> Row:
    grammar = lcgen.Grammar.from_json_schema(EXTRACT)
    measures = _measures(json_prompt, lambda w: JSON_MAX_TOKENS, grammar=grammar)
    return Row(
        "speculate-json",
        "JSON-Schema-constrained extraction from the same passage (6 fields, the notebook's "
        "last entry asked for word for word; SmolLM2 writes short values and copies little), "
        "greedy until the JSON is complete, tokens/s after the first: lcgen's "
        "seq.stream(grammar=...) with speculate='ngram' and without",
        _units(measures),
        interleaved(measures),
        (Check("lcgen, ngram", "lcgen", at_least(JSON_MIN_RATIO)),),
    )


def draft_model_row(work: Workload) -> Row:
    # The bench's model loaded a second time, as a draft model.
    drafts = Lazy(
        lambda b: load_lcgen(b.lcgen.model.path, b.llama_cpp_python.cfg), lcgen.Model.close
    )
    n = work.n_tokens + 1

    def draft_model(bench: Bench) -> lcgen.Model:
        """The draft model, its cache emptied: every run drafts from the same cold state
        (cells cached by an earlier run sit elsewhere in the pool, which moves logits in
        their last bits and flips the draft model's near-ties)."""
        model = drafts.get(bench)
        model.cache.clear()
        return model

    def ours(with_draft: bool) -> Callable[[Bench], Sample]:
        def measure(bench: Bench) -> Sample:
            draft = draft_model(bench) if with_draft else None
            return lcgen_after_first(bench, free_prompt, n, bias=bench.work.bias, speculate=draft)

        return measure

    def acceptance(bench: Bench) -> Sample:
        model = bench.lcgen.model
        with model.sequence(free_prompt(model)) as seq:
            out = seq.generate(
                max_tokens=n,
                temperature=0.0,
                logit_bias=dict(bench.work.bias),
                speculate=draft_model(bench),
            )
        return Sample(1.0, out.stats.accepted / max(1, out.stats.drafted))

    measures = {"lcgen, draft model": ours(True), "lcgen": ours(False)}
    run = interleaved(measures)

    def round_(bench: Bench, r: int) -> dict[str, Sample]:
        return {**run(bench, r), "accepted / drafted": acceptance(bench)}

    return Row(
        "speculate-draft",
        f"the story request of speculate-free, {n} greedy tokens, with the bench's model "
        "loaded a second time as its draft model (speculate=draft_model) and without, "
        "tokens/s after the first: a correctness check (a model drafting for itself should "
        "have nearly every draft accepted, and the same output); its speed shows what a draft "
        "model as costly as the model buys on this machine. 'accepted / drafted': of one "
        "extra run",
        {**_units(measures), "accepted / drafted": "count"},
        round_,
        (Check("lcgen, draft model", "lcgen"), Check("accepted / drafted")),
        close=drafts.close,
    )


FACTORIES: dict[str, RowFactory] = {
    "speculate-copy": copy_row,
    "speculate-free": free_row,
    "speculate-json": json_row,
    "speculate-draft": draft_model_row,
}
