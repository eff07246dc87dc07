"""The drafter of a generation: prompt lookup, or a draft model (see
:mod:`lcgen.decoding.speculation`)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from lcgen.decoding.sampling import SamplerConfig, new_rng, sample
from lcgen.decoding.speculation import AdaptiveLength, Drafter, NgramDrafter, Speculation
from lcgen.errors import ClosedError, ContextFullError
from lcgen.runtime.run import decode
from lcgen.runtime.tokens import ModelLike, TokenSequence, check_model


class ModelDrafter(AdaptiveLength):
    """Drafts with a smaller (or any) model of the same vocabulary, greedily.

    Its own sequence on the draft model follows the target's tokens: each proposal first makes
    it equal them (:meth:`~lcgen.runtime.tokens.TokenSequence.reuse` keeps the cells of the
    common prefix, so what the last draft got right is not decoded again), then decodes up to
    k tokens, one step each (see :class:`AdaptiveLength` for k). Where the draft model has no
    room (the prompt is longer than its context, or its slots or cells are held), the step
    goes without a draft: the output is the same, only slower. :meth:`close` gives the slot
    back at any time; a later proposal opens a sequence again.

    Args:
        model: the draft model.
        num_draft: the most tokens in one draft.
        logit_bias: the generation's logit bias, applied to the draft model's logits too (a
            token the generation bans is never drafted).
    """

    def __init__(
        self, model: ModelLike, num_draft: int, logit_bias: Seq[tuple[int, float]] = ()
    ) -> None:
        super().__init__(num_draft)
        self.model = model
        self._seq: TokenSequence | None = None
        self._greedy = SamplerConfig(temperature=0.0, logit_bias=tuple(logit_bias))
        self._rng = new_rng(0)  # greedy sampling never draws from it
        self._gone = False  # the draft model was closed

    def propose(self, tokens: Seq[int], room: int) -> list[int]:
        if self._gone:
            return []
        try:
            self.model.context.check_open()
            k = self.next_length(min(room, self.model.context.n_ctx - len(tokens) - 1))
            if k <= 0 or not self._follow(tokens):
                return []
            return self._decode_draft(k)
        except ClosedError:
            # The draft model was closed under the generation: a draft is only a speed-up,
            # so the generation goes on without one.
            self._seq, self._gone = None, True
            return []
        except ContextFullError:
            # The draft model's cells are taken (by other generations' drafts or its own
            # sequences). A draft is only a speed-up: this step goes without one, the slot is
            # given back (its cells stay cached for the next try) and drafting pauses.
            self.close()
            self.hold_off()
            return []

    def _follow(self, tokens: Seq[int]) -> bool:
        """Make the draft sequence equal ``tokens``; False, without waiting, when the draft
        model has no slot for it (its slots held by other generations' drafts or its own
        sequences): generations waiting on each other's draft slots would never end."""
        if self._seq is not None:
            self._seq.reuse(tokens)
            return True
        # The KV store's lock: no other thread takes the slot seen here before it is opened.
        with self.model.context.lock:
            if not self.model.cache.available_slots():
                return False
            self._seq = TokenSequence(self.model, tokens)
        return True

    def _decode_draft(self, k: int) -> list[int]:
        """Up to ``k`` greedy tokens after the draft sequence's, one decode each.

        Raises:
            ContextFullError: the draft model's KV cache has no room for them.
        """
        assert self._seq is not None
        seq, draft = self._seq, []
        with self.model.context.in_use():
            for _ in range(k):
                (row,) = decode([seq])
                token = sample(row, self._greedy, self._rng)
                draft.append(token)
                if self.model.vocab.is_eog(token):
                    break
                seq.append_tokens([token])
        return draft

    def close(self) -> None:
        if self._seq is not None:
            self._seq.close()
            self._seq = None


def drafter_for(
    spec: Speculation | None, target: ModelLike, logit_bias: Seq[tuple[int, float]] = ()
) -> Drafter | None:
    """The drafter of a generation on ``target`` (None without speculation); a draft model
    drafts under the generation's ``logit_bias``.

    Raises:
        ValueError: the draft model cannot draft for ``target`` (see :func:`check_draft_model`).
    """
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramDrafter(spec.num_draft)
    check_draft_model(target, spec.draft)
    return ModelDrafter(spec.draft, spec.num_draft, logit_bias)


def check_draft_model(target: ModelLike, draft: ModelLike) -> None:
    """Whether ``draft`` can draft for ``target``.

    Raises:
        TypeError: either is not a model (an :class:`lcgen.Model`).
        ClosedError: the draft model is closed.
        ValueError: it is the target itself (it would share the target's context and its
            logits buffer: load it again), or its vocabulary differs.
    """
    check_model(target, "the model must be an lcgen.Model")
    check_model(draft, "the draft model must be an lcgen.Model")
    try:
        draft.context.check_open()  # (its vocabulary, read once, would not tell)
    except ClosedError as exc:  # (the same file as the model's reads as the model itself)
        raise ClosedError(f"the draft model (speculate=) is closed: {exc}") from None
    if draft.context is target.context:
        raise ValueError(
            "the draft model is the model generating: load the file again as a separate "
            "model for speculate= (e.g. lcgen.load(path)), or use speculate='ngram'"
        )
    ours, theirs = target.vocab, draft.vocab
    if ours.n_vocab != theirs.n_vocab or ours.all_pieces() != theirs.all_pieces():
        raise ValueError(
            f"the draft model's vocabulary ({theirs.n_vocab} tokens, {draft.path.name}) differs "
            f"from the model's ({ours.n_vocab} tokens, {target.path.name}): a draft model must "
            "tokenize exactly as the model does"
        )
