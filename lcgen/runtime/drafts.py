"""The drafter of a generation: prompt lookup, or a draft model (see
:mod:`lcgen.decoding.speculation`)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from lcgen.decoding.sampling import SamplerConfig, new_rng, sample
from lcgen.decoding.speculation import AdaptiveLength, Drafter, NgramDrafter, Speculation
from lcgen.runtime.run import decode
from lcgen.runtime.tokens import ModelLike, TokenSequence, check_model


class ModelDrafter(AdaptiveLength):
    """Drafts with a smaller (or any) model of the same vocabulary, greedily.

    Its own sequence on the draft model follows the target's tokens: each proposal first makes
    it equal them (:meth:`~lcgen.runtime.tokens.TokenSequence.reuse` keeps the cells of the
    common prefix, so what the last draft got right is not decoded again), then decodes up to
    k tokens, one step each (see :class:`AdaptiveLength` for k).

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

    def propose(self, tokens: Seq[int], room: int) -> list[int]:
        k = self.next_length(min(room, self.model.context.n_ctx - len(tokens) - 1))
        if k <= 0:
            return []
        if self._seq is None:
            self._seq = TokenSequence(self.model, tokens)
        else:
            self._seq.reuse(tokens)
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
        ValueError: it is the target itself (it would share the target's context and its
            logits buffer: load it again), or its vocabulary differs.
    """
    check_model(target, "the model must be an lcgen.Model")
    check_model(draft, "the draft model must be an lcgen.Model")
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
