"""One llama.cpp context shared by many sequences: batched decode and memory edits, with an
exact ledger of the KV cells (see :mod:`lcgen.runtime.cells`).

Every call that touches the context holds one lock, so sequences may be driven from several
threads; a single sequence should be driven by one thread at a time. Which sequence id belongs
to whom is the KV store's business (:mod:`lcgen.runtime.kvstore`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from lcgen._native.context import ContextHandle
from lcgen._native.model import ModelHandle
from lcgen.errors import ClosedError, ContextFullError, StateFileError
from lcgen.runtime.cells import CellLedger
from lcgen.runtime.costs import TILE, DecodeCosts
from lcgen.runtime.threads import OVERLAPS, Span, ThreadTuner, own_cpu

PAD_TO = TILE  # llama.cpp's CPU flash attention works in tiles of rows from this many tokens
PAD_MARGIN = 1.15  # a batch is padded when its rows are predicted this much slower than tiles

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Tokens to append to one sequence's KV memory.

    Args:
        seq_id: the slot.
        tokens: the tokens, in order.
        pos: the position of the first token.
        want_logits: whether the logits after the last token are needed.
        n_outputs: how many of the last tokens the logits are needed after (a speculative
            step verifies a draft with the logits after each of its tokens).
    """

    seq_id: int
    tokens: Sequence[int]
    pos: int
    want_logits: bool = True
    n_outputs: int = 1


def finished(edit: Callable[[], T]) -> T:
    """``edit()``, an idempotent edit of the memory and the ledger, made once more where an
    exception interrupted it: Ctrl-C during a llama.cpp call is raised as the call returns,
    before the ledger hears of it (the ledger would be out of step with the cells for good).
    """
    try:
        return edit()
    except BaseException:
        edit()
        raise


def check_fits(n_tokens: int, n_ctx: int) -> None:
    """Refuse a prompt longer than the context before anything is decoded.

    Raises:
        ContextFullError: with both numbers.
    """
    if n_tokens > n_ctx:
        raise ContextFullError(
            f"the prompt of {n_tokens} tokens exceeds the context of {n_ctx} tokens: shorten "
            "it or load the model with a larger n_ctx"
        )


class Context:
    """Owns a ``llama_context``: decodes batches, edits the memory, keeps the cell ledger."""

    def __init__(
        self,
        model: ModelHandle,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int,
        n_threads: int,
        flash_attn: bool | None = None,
        swa_full: bool = True,
        adaptive_threads: bool = False,
        pad_batches: bool = False,
        type_k: str = "f16",
        type_v: str = "f16",
    ) -> None:
        # Padding takes a sequence id beyond the slots (llama.cpp allows 256 in all, and
        # wants n_batch and n_ctx at least as large as their count); a sliding window's own
        # small cache (swa_full=False) would hold the padding in its window. llama.cpp tiles
        # rows only with an f16 cache (an f32 one is cast to f16).
        pad_batches = (
            pad_batches
            and type_k == type_v
            and type_k in ("f16", "f32")
            and (swa_full or not model.n_swa)
            and min(n_batch, n_ctx) >= PAD_TO
            and n_seq_max < min(n_batch, n_ctx, 256)
        )
        self._handle = ContextHandle(
            model,
            n_ctx,
            n_batch,
            n_seq_max,
            n_threads,
            flash_attn,
            swa_full,
            pad_batches,
            type_k,
            type_v,
        )
        self.pad_batches = pad_batches
        self._n_threads = n_threads
        self.kv_types = (type_k, type_v)  # the cache's element types (saved states carry them)
        self.n_padded = 0  # padding tokens decoded (not in n_decoded)
        # With adaptive threads, each decode runs with the count measured fastest (at most
        # n_threads): see lcgen.runtime.threads.
        self.threads = (
            ThreadTuner(n_threads, self._handle.set_threads) if adaptive_threads else None
        )
        self.lock = threading.RLock()
        self._idle = threading.Condition(self.lock)
        self._in_use: dict[int, int] = {}  # thread -> steps it is in (close waits for them)
        self._closing = False
        self.ledger = CellLedger()
        # A recurrent state is no cells per position: no prefix of it can be shared.
        self._recurrent = model.is_recurrent
        # Called when the memory has no room for a batch; frees some (True) or cannot (False).
        self.on_full: Callable[[], bool] | None = None
        self.n_decoded = 0  # tokens decoded over the context's life, for cost accounting
        # What decodes take here, learned where the thread count adapts (which already makes
        # batch shapes depend on timing); a fixed count keeps the prior: reproducible runs.
        self.costs = DecodeCosts()
        self._costs_threads = n_threads

    @property
    def n_ctx(self) -> int:
        """The most tokens one sequence can hold."""
        return self._handle.n_ctx_seq

    @property
    def n_cells(self) -> int:
        """The cells of the memory, shared by all sequences."""
        return self._handle.n_ctx

    @property
    def n_batch(self) -> int:
        return self._handle.n_batch

    @property
    def n_seq_max(self) -> int:
        return self._handle.n_seq_max

    @property
    def is_open(self) -> bool:
        return self._handle.ptr is not None

    @property
    def locked_here(self) -> bool:
        """Whether this thread holds :attr:`lock` (inside a decode or the store's work: a
        finalizer the garbage collector runs there must not change what they walk)."""
        return bool(self.lock._is_owned())  # type: ignore[attr-defined]  # as Condition uses it

    # memory ------------------------------------------------------------------------------
    def truncate(self, seq_id: int, n_keep: int) -> bool:
        """Drop positions >= n_keep of a sequence, keeping [0, n_keep) usable.

        Returns:
            False when the memory cannot: it refuses a partial removal (recurrent), or it no
            longer holds the positions the next token attends to (a sliding-window cache that is
            not full size drops old positions, yet ``llama_memory_seq_rm`` still succeeds).
        """
        with self.lock:
            if not finished(lambda: self._remove(seq_id, n_keep)):
                return False
            return n_keep == 0 or self.holds_window(seq_id, n_keep)

    def _remove(self, seq_id: int, pos: int) -> bool:
        """Drop a sequence's positions >= pos, in llama.cpp and in the ledger (idempotent)."""
        if not self._handle.seq_rm(seq_id, pos, -1):
            return False
        self.ledger.removed(seq_id, pos)
        return True

    def holds_window(self, seq_id: int, n_keep: int) -> bool:
        """Whether the sequence holds exactly [0, n_keep) as the next token needs it: every
        position, or (a sliding-window cache that is not full size) the last window of them."""
        with self.lock:
            pos_max = self._handle.seq_pos_range(seq_id)[1]
            return pos_max == n_keep - 1 and self.serves(seq_id, n_keep)

    def serves(self, seq_id: int, n_keep: int) -> bool:
        """Whether the sequence's cells can give a copy [0, n_keep) as the next token needs it
        (see :meth:`holds_window`): a sliding-window cache that is not full size, or a state
        restored from bytes (llama.cpp saves only a window's last positions), may have lost
        the start of it."""
        return self.first_served(seq_id) <= n_keep

    def first_served(self, seq_id: int) -> float:
        """The fewest positions [0, n) the sequence's cells serve (see :meth:`serves`; it
        serves every longer prefix it holds): 0 with position 0 held, else, with a sliding
        window, the first whose next token attends to nothing before the cells; ``inf`` for
        none (no cells, or the start lost without a window)."""
        with self.lock:
            pos_min = self._handle.seq_pos_range(seq_id)[0]
            n_swa = self._handle.n_swa
        if pos_min == 0:
            return 0
        # The next token (position n) attends to positions > n - n_swa.
        return pos_min + n_swa - 1 if pos_min > 0 and n_swa else math.inf

    def clear_slot(self, seq_id: int) -> None:
        with self.lock:
            if self.is_open:
                finished(lambda: self._remove(seq_id, 0))
            else:
                self.ledger.removed(seq_id, 0)

    def copy_slot(self, src: int, dst: int, n_keep: int) -> None:
        """Make ``dst`` (empty) share the first ``n_keep`` positions of ``src`` (no KV bytes
        copied)."""
        with self.lock:
            self._handle.seq_cp(src, dst, 0, n_keep)
            self.ledger.copied(src, dst, n_keep)

    def share_prefix(self, src: int, dst: int, n: int) -> int:
        """Make ``dst``, a state restored from bytes (its cells its own), hold ``src``'s cells
        at its first ``n`` positions instead of its own, which are dropped: the same tokens at
        the same positions, which a restore would otherwise hold twice.

        A sliding window's cells are restored only for each window's last positions: where
        ``dst`` would lose some its window needs, or hold a gap, only the positions below both
        windows' first ones are shared (the full-attention cells: ``dst``'s window is kept).

        Returns:
            How many positions ``dst`` shares now (0 for a recurrent memory).
        """
        with self.lock:
            held = self.ledger.held(dst)
            n = min(n, held, self.ledger.held(src))
            low_src, low_dst = (
                self._handle.seq_pos_range(src)[0],
                self._handle.seq_pos_range(dst)[0],
            )
            if not low_src <= low_dst <= n:
                n = min(n, low_src, low_dst)
            if self._recurrent or n <= 0:
                return 0
            return n if finished(lambda: self._share(src, dst, n, held)) else 0

    def _share(self, src: int, dst: int, n: int, held: int) -> bool:
        """:meth:`share_prefix`'s edit, in llama.cpp and in the ledger (idempotent)."""
        if not self._handle.seq_rm(dst, 0, n):
            return False
        self._handle.seq_cp(src, dst, 0, n)
        # As if ``dst`` had copied the prefix and decoded the rest (its own cells).
        self.ledger.removed(dst, 0)
        self.ledger.copied(src, dst, n)
        self.ledger.decoded(dst, n, held - n)
        return True

    def pos_range(self, seq_id: int) -> tuple[int, int]:
        with self.lock:
            return self._handle.seq_pos_range(seq_id)

    # state -------------------------------------------------------------------------------
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

    def set_seq_state(self, seq_id: int, data: bytes | bytearray | memoryview) -> int:
        """Load a state written by :meth:`seq_state_into` into ``seq_id``.

        Returns:
            How many positions the sequence holds now.

        Raises:
            ContextFullError: the memory has no room for it, and nothing could be freed.
            StateFileError: llama.cpp rejects the state, or its cells are not at the positions
                a sequence's are (see :func:`check_cell_positions`).
        """
        if not self._recurrent:
            check_cell_positions(data, sliding=bool(self._handle.n_swa))
        with self.lock:
            self.ledger.removed(seq_id, 0)  # llama.cpp replaces what the id held
            while True:
                try:
                    self._handle.set_seq_state(seq_id, data)
                    break
                except ContextFullError:
                    if self.on_full is None or not self.on_full():
                        raise
            n = self._handle.seq_pos_range(seq_id)[1] + 1
            self.ledger.decoded(seq_id, 0, n)
            return n

    # decoding ----------------------------------------------------------------------------
    def decode(self, requests: Sequence[DecodeRequest]) -> list[np.ndarray | None]:
        """Decode the requests together, in as few ``llama_decode`` calls as ``n_batch`` allows.
        When the memory is full, :attr:`on_full` is asked to free cells and the batch is tried
        again.

        Returns:
            For each request, the logits after its last token (shape (n_vocab,)), or after
            each of its last ``n_outputs`` tokens (shape (n_outputs, n_vocab)), or None when
            not wanted. The rows are copied out of llama.cpp's logits buffer before the lock
            is released: the next decode, in any thread, overwrites that buffer, or frees it
            when it needs more rows than it holds (readers of views into it in other threads
            saw another step's logits, or crashed). A row costs about 7 us to copy (49k
            tokens; 27 us for 262k), under 0.5% of a decode.

        Raises:
            ContextFullError: the memory has no room, and nothing could be freed.
        """
        with self.lock:  # the padding reads the cell ledger, which other threads change
            pad = self._padding(requests)
            if not pad and len(requests) == 1 and 0 < len(requests[0].tokens) <= self.n_batch:
                return [self._decode_one(requests[0])]
            return self._decode_batch(requests, pad)

    def _decode_batch(self, requests: Sequence[DecodeRequest], pad: int) -> list[np.ndarray | None]:
        """:meth:`decode` in ``n_batch`` chunks, padded by ``pad`` tokens; under the lock."""
        flat = _flatten(requests)
        n = len(flat[0])
        if n == 0:
            return [None] * len(requests)
        owner = flat[4]
        begins = [0, *itertools.accumulate(len(r.tokens) for r in requests)]
        outputs: list[list[np.ndarray]] = [[] for _ in requests]
        for start in range(0, n, self.n_batch):
            end = min(start + self.n_batch, n)
            out = flat[3][start:end].astype(bool)
            arrays = [a[start:end] for a in flat[:4]]  # tokens, positions, ids, outputs
            if pad:  # a padded batch is one chunk: the padding goes after it
                arrays = _padded(arrays, pad, self.n_seq_max)
            try:
                logits = self._decode_chunk(
                    functools.partial(self._handle.decode, *arrays), len(arrays[0])
                )
            finally:
                if pad:
                    self._handle.seq_rm(self.n_seq_max, -1, -1)
            self.n_decoded += end - start
            self.n_padded += pad
            self._record(requests, begins, start, end)
            if start == 0 and end == n:
                return _rows(requests, owner[out], logits)
            for row, i in enumerate(owner[start:end][out]):
                outputs[i].append(logits[row].copy())
        return [
            None if not rows else rows[0] if req.n_outputs == 1 else np.stack(rows)
            for req, rows in zip(requests, outputs, strict=True)
        ]

    def _padding(self, requests: Sequence[DecodeRequest]) -> int:
        """How many tokens of padding make the batch of ``requests`` cheaper (0: none).

        llama.cpp's CPU flash attention takes a batch of fewer than 64 tokens row by row, each
        row walking the whole cache on its own; from 64 rows it works in tiles of rows. So
        from a few dozen tokens on (fewer the longer the cache), a batch padded to 64 with
        tokens of a spare sequence (decoded, then removed) can take less time: on a 2-core
        laptop CPU, 50 tokens after 1,500 cached ones 935 -> 310 ms; but on a 2-core AVX-512
        machine 50 rows after 300 took 0.85 of 64 tiled. The times are predicted by
        :mod:`lcgen.runtime.costs`, from this context's own decodes where the thread count
        adapts (a fixed count keeps its prior, the laptop's shape: batch shapes, and so
        logits, stay reproducible), with a margin. Padding moves logits in their last bits
        as any other batch shape does.
        """
        if not self.pad_batches:
            return 0
        n = sum(len(r.tokens) for r in requests)
        if not 2 <= n < PAD_TO:
            return 0
        k = PAD_TO - n
        cells = self.ledger.n_cells() + n
        if cells + k > self.n_cells:
            return 0
        rows, tiles = self.costs.seconds(np.array([n, PAD_TO]), cells)
        return k if rows > PAD_MARGIN * tiles else 0

    def _decode_one(self, req: DecodeRequest) -> np.ndarray | None:
        """:meth:`decode` of one request that fits one batch, without the flat arrays."""
        n = len(req.tokens)
        n_out = min(req.n_outputs, n) if req.want_logits else 0
        decode = functools.partial(self._handle.decode_seq, req.tokens, req.pos, req.seq_id, n_out)
        with self.lock:
            logits = self._decode_chunk(decode, n)
            self.n_decoded += n
            self.ledger.decoded(req.seq_id, req.pos, n)
            if not n_out:
                return None
            rows = logits.copy()  # before the lock goes: see decode
        return rows[0] if req.n_outputs == 1 else rows

    def _decode_chunk(self, decode: Callable[[], np.ndarray], n: int) -> np.ndarray:
        """``decode()`` of ``n`` tokens, retried while :attr:`on_full` frees cells; timed for
        the thread tuner and the cost model."""
        threads = self.threads
        while True:
            try:
                if threads is not None:
                    threads.before(n)
                n_threads = self._n_threads if threads is None else threads.applied
                span = Span(n_threads)
                try:
                    OVERLAPS.start(span)
                    wall, cpu = time.perf_counter(), time.process_time()
                    logits = decode()
                finally:
                    thread_seconds = OVERLAPS.end(span)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                if threads is not None:
                    threads.after(n, wall, own_cpu(cpu, wall, n_threads, thread_seconds))
                self._observe(n, wall)
                return logits
            except ContextFullError:
                if self.on_full is None or not self.on_full():
                    raise

    def _observe(self, n: int, wall: float) -> None:
        """Enter a decode's time in the cost model where the thread count adapts; a new count
        starts it afresh, and a probe (a few decodes at another count) is left out."""
        threads = self.threads
        if threads is None or threads.probing:
            return
        if threads.n != self._costs_threads:
            self._costs_threads = threads.n
            self.costs.reset()
        self.costs.observe(n, self.ledger.n_cells() + n, wall)

    def _record(
        self, requests: Sequence[DecodeRequest], begins: list[int], start: int, end: int
    ) -> None:
        """Enter the cells one chunk (flat tokens ``[start, end)``) made in the ledger."""
        for req, begin in zip(requests, begins, strict=False):
            lo, hi = max(begin, start), min(begin + len(req.tokens), end)
            if hi > lo:
                self.ledger.decoded(req.seq_id, req.pos + lo - begin, hi - lo)

    @property
    def closing(self) -> bool:
        """The model is closed or being closed: no new step starts."""
        return self._closing

    def check_open(self) -> None:
        """Raise :class:`~lcgen.ClosedError` once the model is closed (or being closed)."""
        if self._closing:
            self._handle.live()  # raises ClosedError once closed
            raise ClosedError("the model is being closed")

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """A step: decoding and reading the logits it returned. :meth:`close` waits until no
        other thread is inside one."""
        me, counted = threading.get_ident(), False
        try:
            with self.lock:
                self.check_open()
                self._in_use[me] = self._in_use.get(me, 0) + 1
                counted = True
            yield
        finally:
            if counted:
                self._leave(me)

    def _leave(self, me: int) -> None:
        """This thread's step ended. Ctrl-C while it waits for the lock (another thread's
        decode holds it) is raised once the step is no longer counted: else :meth:`close`
        would wait for it for ever."""
        left, interrupt = False, None
        while True:
            try:
                with self.lock:
                    if not left:
                        self._in_use[me] -= 1
                        if not self._in_use[me]:
                            del self._in_use[me]
                        left = True
                    self._idle.notify_all()
                break
            except BaseException as exc:  # (KeyboardInterrupt: try again, raise it after)
                interrupt = interrupt or exc
        if interrupt is not None:
            raise interrupt

    def close(self) -> None:
        """Free the context once no other thread is inside a step (it then gets
        :class:`~lcgen.ClosedError` at its next call). Idempotent.

        Raises:
            ValueError: called from inside a step of this thread (a hook, a validator).
        """
        with self.lock:
            self.start_closing()
            while self._in_use:
                self._idle.wait()
            self._handle.close()

    def start_closing(self) -> None:
        """Let no new step start (the ones running end; a thread waiting inside one for a
        slot raises :class:`~lcgen.ClosedError` once woken).

        Raises:
            ValueError: called from inside a step of this thread (a hook, a validator).
        """
        with self.lock:
            if threading.get_ident() in self._in_use:
                raise ValueError(
                    "cannot close the model from inside a generation step (a hook or a "
                    "validator): close it after the generation"
                )
            self._closing = True


_Flat = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _rows(
    requests: Sequence[DecodeRequest], owners: np.ndarray, logits: np.ndarray
) -> list[np.ndarray | None]:
    """Each request's rows of a batch decoded in one call (``logits``' row ``r`` belongs to
    request ``owners[r]``; a request's rows are adjacent), as views into one copy of them."""
    logits = logits.copy()  # see decode
    first = np.searchsorted(owners, np.arange(len(requests))).tolist()
    out: list[np.ndarray | None] = []
    for req, at in zip(requests, first, strict=True):
        if not req.want_logits or not req.tokens:
            out.append(None)
        elif req.n_outputs == 1:
            out.append(logits[at])
        else:
            out.append(logits[at : at + min(req.n_outputs, len(req.tokens))])
    return out


def _padded(arrays: list[np.ndarray], k: int, spare: int) -> list[np.ndarray]:
    """A batch's token, position, seq id and output arrays with ``k`` tokens of padding after
    its own, in sequence ``spare`` from position 0, without outputs."""
    tokens, pos, seq, out = arrays
    return [
        np.concatenate([tokens, np.full(k, tokens[0], dtype=np.int32)]),
        np.concatenate([pos, np.arange(k, dtype=np.int32)]),
        np.concatenate([seq, np.full(k, spare, dtype=np.int32)]),
        np.concatenate([out, np.zeros(k, dtype=np.int8)]),
    ]


def _flatten(requests: Sequence[DecodeRequest]) -> _Flat:
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
        if req.want_logits:
            out[at + max(0, size - req.n_outputs) : at + size] = 1
        at += size
    return tokens, pos, seq, out, owner


# A saved state's KV table: a stream count (1), a cell count, each cell's position, its count of
# sequence ids (1 in a sequence's state) and, for models whose cells carry more (M-RoPE,
# per-layer embeddings), 12 bytes of that; then the data: v_trans (0 or 1), a layer count, and
# each layer's keys and values. A model with sliding-window and full-attention layers (iSWA:
# Gemma 3) writes two such tables, the full layers' and the window's.
_CELL_SIZES = (12, 24)


def check_cell_positions(data: bytes | bytearray | memoryview, *, sliding: bool) -> None:
    """Refuse a saved sequence state whose cells are not at consecutive positions from 0
    (from where a sliding window starts, for a model that has one), in any order, in each of
    its KV tables. llama.cpp loads the positions as written: a forged state's cell at a
    negative position could never be removed again (removals start at 0) and joined the
    attention of every later sequence in the slot.

    Raises:
        StateFileError: the positions are not such, or a cell table does not parse.
    """
    view = memoryview(data).cast("B")
    at = 8  # after llama.cpp's magic and the sequence id
    while len(view) >= at + 8:
        end = _check_table(view, at, sliding)
        if end is None or end >= len(view):
            return
        at = end


def _check_table(view: memoryview, at: int, sliding: bool) -> int | None:
    """Check the KV table at ``at``; returns where it ends (None: where its data does not
    parse as one that a second table could follow, as llama.cpp would find)."""
    n_stream, count = struct.unpack_from("<II", view, at)
    if n_stream != 1:
        raise StateFileError(f"the saved KV state has {n_stream} streams, not the 1 lcgen writes")
    if count == 0:
        return at + 8
    for size in _CELL_SIZES:
        cells_end = at + 8 + count * size
        if cells_end + 8 > len(view):
            continue
        v_trans, n_layer = struct.unpack_from("<II", view, cells_end)
        cells = np.frombuffer(view[at + 8 : cells_end], dtype="<i4").reshape(count, size // 4)
        if v_trans > 1 or not 0 < n_layer <= 4096 or not (cells[:, 1] == 1).all():
            continue
        # In the order the cells lie in the pool, which is not the positions' order where a
        # sequence's later cells went to cells freed before its first.
        pos = np.sort(cells[:, 0].astype(np.int64))
        if pos[0] < 0 or (pos[0] != 0 and not sliding) or (np.diff(pos) != 1).any():
            raise StateFileError(
                f"the saved KV state's {count} cells are not at consecutive positions from "
                f"{'a window start' if sliding else 0} (lowest {int(pos[0])}): not a state "
                "lcgen wrote"
            )
        return _data_end(view, cells_end + 8, count, v_trans, n_layer)
    raise StateFileError(f"the saved KV state's table of {count} cells does not parse")


def _data_end(view: memoryview, at: int, count: int, v_trans: int, n_layer: int) -> int | None:
    """Where a table's data ends: each layer's keys (type, row size, a row per cell), then
    its values (the same, or transposed: type, element size, width, the elements), as
    llama.cpp writes them for a model whose every layer has values; None past the end."""
    for values in (False, True):
        for _ in range(n_layer):
            if values and v_trans:
                if at + 12 > len(view):
                    return None
                _type, size, width = struct.unpack_from("<iII", view, at)
                at += 12 + size * width * count
            else:
                if at + 12 > len(view):
                    return None
                _type, row = struct.unpack_from("<iQ", view, at)
                at += 12 + row * count
    return at if at <= len(view) else None
