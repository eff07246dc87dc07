"""One llama.cpp context shared by many live sequences: slots, batched decode, memory edits.

Every call that touches the context holds one lock, so sequences may be driven from several
threads; a single sequence should be driven by one thread at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lcgen._native.context import ContextHandle
from lcgen._native.model import ModelHandle
from lcgen.errors import SlotsExhaustedError


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Tokens to append to one sequence's KV memory.

    Args:
        seq_id: the slot.
        tokens: the tokens, in order.
        pos: the position of the first token.
        want_logits: whether the logits after the last token are needed.
    """

    seq_id: int
    tokens: Sequence[int]
    pos: int
    want_logits: bool = True


class Context:
    """Owns a ``llama_context`` and hands out its sequence slots."""

    def __init__(
        self,
        model: ModelHandle,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int,
        n_threads: int,
        flash_attn: bool | None = None,
        swa_full: bool = True,
    ) -> None:
        self._handle = ContextHandle(
            model, n_ctx, n_batch, n_seq_max, n_threads, flash_attn, swa_full
        )
        self._free = list(range(n_seq_max - 1, -1, -1))
        # Called in turn when no slot is free; each gives one back (True) or cannot (False).
        self.reclaimers: list[Callable[[], bool]] = []
        self.lock = threading.RLock()
        self.n_decoded = 0  # tokens decoded over the context's life, for cost accounting

    @property
    def n_ctx(self) -> int:
        return self._handle.n_ctx_seq

    @property
    def n_batch(self) -> int:
        return self._handle.n_batch

    @property
    def n_seq_max(self) -> int:
        return self._handle.n_seq_max

    @property
    def n_free_slots(self) -> int:
        return len(self._free)

    def acquire_slot(self) -> int:
        """Reserve an empty sequence slot; when none is free, the reclaimers are asked to give
        one back (idle continuous states keep their tokens and give up their slots).

        Raises:
            SlotsExhaustedError: every slot is held by a live sequence.
        """
        with self.lock:
            for reclaim in self.reclaimers:
                if self._free:
                    break
                reclaim()
            if not self._free:
                raise SlotsExhaustedError(
                    f"all {self.n_seq_max} sequence slots are in use: close a sequence "
                    f"(seq.close() or a with-block) or load the model with n_seq_max > "
                    f"{self.n_seq_max}"
                )
            return self._free.pop()

    def release_slot(self, seq_id: int) -> None:
        """Drop the slot's memory and make it available again."""
        with self.lock:
            if self._handle.ptr is None:
                return
            self._handle.seq_rm(seq_id, -1, -1)
            assert seq_id not in self._free, seq_id
            self._free.append(seq_id)

    def truncate(self, seq_id: int, n_keep: int) -> bool:
        """Drop positions >= n_keep of a sequence, keeping [0, n_keep) usable.

        Returns:
            False when the memory cannot: it refuses a partial removal (recurrent), or it no
            longer holds the positions the next token attends to (a sliding-window cache that is
            not full size drops old positions, yet ``llama_memory_seq_rm`` still succeeds).
        """
        with self.lock:
            if not self._handle.seq_rm(seq_id, n_keep, -1):
                return False
            if n_keep == 0:
                return True
            pos_min, pos_max = self._handle.seq_pos_range(seq_id)
            # The next token (position n_keep) attends to positions > n_keep - n_swa.
            needed = max(0, n_keep - self._handle.n_swa + 1) if self._handle.n_swa else 0
            return pos_max == n_keep - 1 and 0 <= pos_min <= needed

    def clear_slot(self, seq_id: int) -> None:
        with self.lock:
            self._handle.seq_rm(seq_id, -1, -1)

    def copy_slot(self, src: int, dst: int, n_keep: int) -> None:
        """Make ``dst`` share the first ``n_keep`` positions of ``src`` (no KV bytes copied)."""
        with self.lock:
            self._handle.seq_cp(src, dst, 0, n_keep)

    def pos_range(self, seq_id: int) -> tuple[int, int]:
        with self.lock:
            return self._handle.seq_pos_range(seq_id)

    def state_size(self) -> int:
        """The size in bytes of the whole context's state (every sequence's cells)."""
        with self.lock:
            return self._handle.state_size()

    def seq_state_size(self, seq_id: int) -> int:
        with self.lock:
            return self._handle.seq_state_size(seq_id)

    def seq_state_into(self, seq_id: int, out: bytearray, offset: int, size: int) -> int:
        """Write the slot's llama.cpp state into ``out`` at ``offset``; returns its size."""
        with self.lock:
            return self._handle.seq_state_into(seq_id, out, offset, size)

    def set_seq_state(self, seq_id: int, data: bytes | bytearray | memoryview) -> None:
        with self.lock:
            self._handle.set_seq_state(seq_id, data)

    def decode(self, requests: Sequence[DecodeRequest]) -> list[np.ndarray | None]:
        """Decode the requests together, in as few ``llama_decode`` calls as ``n_batch`` allows.

        Returns:
            For each request, the logits after its last token (shape (n_vocab,)) or None when
            not wanted. A row is a view valid until the next decode when every request fit in
            one batch, else a copy.
        """
        flat = _flatten(requests)
        n = len(flat[0])
        rows: list[np.ndarray | None] = [None] * len(requests)
        if n == 0:
            return rows
        owner = flat[4]
        with self.lock:
            for start in range(0, n, self.n_batch):
                end = min(start + self.n_batch, n)
                out = flat[3][start:end]
                logits = self._handle.decode(
                    flat[0][start:end], flat[1][start:end], flat[2][start:end], out
                )
                self.n_decoded += end - start
                single = start == 0 and end == n
                for row, i in enumerate(owner[start:end][out.astype(bool)]):
                    rows[i] = logits[row] if single else logits[row].copy()
        return rows

    def close(self) -> None:
        with self.lock:
            self._handle.close()


def _flatten(
    requests: Sequence[DecodeRequest],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token, position, seq id, output flag and request index arrays for a list of requests."""
    sizes = [len(r.tokens) for r in requests]
    n = sum(sizes)
    tokens = np.empty(n, dtype=np.int32)
    pos = np.empty(n, dtype=np.int32)
    seq = np.empty(n, dtype=np.int32)
    out = np.zeros(n, dtype=np.int8)
    owner = np.empty(n, dtype=np.int64)
    at = 0
    for i, (req, size) in enumerate(zip(requests, sizes, strict=True)):
        if size == 0:
            continue
        tokens[at : at + size] = req.tokens
        pos[at : at + size] = np.arange(req.pos, req.pos + size, dtype=np.int32)
        seq[at : at + size] = req.seq_id
        owner[at : at + size] = i
        out[at + size - 1] = 1 if req.want_logits else 0
        at += size
    return tokens, pos, seq, out, owner
