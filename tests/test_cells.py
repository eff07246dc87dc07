"""The cell ledger against a brute-force model of llama.cpp's cell pool (hypothesis)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from lcgen.runtime.cells import CellLedger

N_IDS = 4


class Pool:
    """Cells as (unique id, position) with the set of sequence ids holding each."""

    def __init__(self) -> None:
        self.cells: dict[int, tuple[int, set[int]]] = {}
        self.ids = itertools.count()

    def held(self, seq: int) -> int:
        return sum(1 for _, owners in self.cells.values() if seq in owners)

    def decode(self, seq: int, n: int) -> None:
        pos = self.held(seq)
        for k in range(n):
            self.cells[next(self.ids)] = (pos + k, {seq})

    def copy(self, src: int, dst: int, n: int) -> None:
        for pos, owners in self.cells.values():
            if src in owners and pos < n:
                owners.add(dst)

    def shared_prefix(self, seq: int) -> int:
        """How many of seq's first positions are cells another id holds too."""
        shared = {p for p, owners in self.cells.values() if seq in owners and len(owners) > 1}
        n = 0
        while n in shared:
            n += 1
        return n

    def remove(self, seq: int, pos: int) -> None:
        for cell, (p, owners) in list(self.cells.items()):
            if p >= pos:
                owners.discard(seq)
            if not owners:
                del self.cells[cell]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("decode"), st.integers(0, N_IDS - 1), st.integers(1, 5)),
        st.tuples(st.just("copy"), st.integers(0, N_IDS - 1), st.integers(0, N_IDS - 1)),
        st.tuples(st.just("remove"), st.integers(0, N_IDS - 1), st.integers(0, 12)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.data())
def test_the_ledger_counts_what_the_pool_holds(
    steps: list[tuple[str, int, int]], data: st.DataObject
) -> None:
    ledger, pool = CellLedger(), Pool()
    for op, a, b in steps:
        if op == "decode":
            pos = pool.held(a)
            pool.decode(a, b)
            ledger.decoded(a, pos, b)
        elif op == "copy":
            if a == b or pool.held(b):
                continue  # lcgen copies only into an empty id
            n = data.draw(st.integers(0, pool.held(a)))
            pool.copy(a, b, n)
            ledger.copied(a, b, n)
        else:
            pool.remove(a, b)
            ledger.removed(a, b)
        assert ledger.n_cells() == len(pool.cells)
        for seq in range(N_IDS):
            assert ledger.held(seq) == pool.held(seq)
            alone = sum(1 for _, owners in pool.cells.values() if owners == {seq})
            assert ledger.exclusive(seq) == alone
            assert ledger.shared_prefix(seq) == pool.shared_prefix(seq)


def test_a_copy_then_both_decode_makes_separate_cells() -> None:
    ledger = CellLedger()
    ledger.decoded(0, 0, 10)
    ledger.copied(0, 1, 6)
    assert ledger.n_cells() == 10 and ledger.exclusive(0) == 4 and ledger.exclusive(1) == 0
    ledger.decoded(1, 6, 3)  # positions 6..8 again, other cells
    assert ledger.n_cells() == 13 and ledger.exclusive(1) == 3
    ledger.removed(0, 0)
    assert ledger.n_cells() == 9 and ledger.held(0) == 0
