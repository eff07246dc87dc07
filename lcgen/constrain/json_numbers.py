"""GBNF for the numbers of one conjunction of plain JSON Schemas (part of
:mod:`lcgen.constrain.json_values`): ranges, and ``multipleOf`` in exact decimal arithmetic, as
the specification says (19.99 is a multiple of 0.01, 4.5 of 1.5)."""

from __future__ import annotations

import contextlib
import functools
import math
from decimal import Decimal

from lcgen.constrain import gbnf as g
from lcgen.constrain import json_rules as spec
from lcgen.constrain.json_rules import Conj, NoValue, Unsatisfiable
from lcgen.errors import GrammarError, UnsupportedSchemaError

MAX_LISTED = 256  # multiples within bounds written out as literals
MAX_STEP_STATES = 256  # divisibility states (residues times places) of one multipleOf
MAX_RANGE_STATES = 4096  # residues times digits of a bounded integer multipleOf
# A number that is no integer is written with at most 9 digits before the point and 6 after:
# 15 significant digits, which a double holds, so it reads back as no integer either.
FRACTION_LIMIT, FRACTION_PLACES = Decimal(10**9), 6


def _common_step(steps: list[Decimal]) -> tuple[int, int]:
    """(unit, scale) with unit / 10**scale the least common multiple of the steps, unit not a
    multiple of 10 unless scale is 0."""
    scale = max(max(0, -int(s.normalize().as_tuple().exponent)) for s in steps)
    unit = math.lcm(*(int(s.scaleb(scale)) for s in steps))
    while scale and unit % 10 == 0:
        unit, scale = unit // 10, scale - 1
    return unit, scale


def _tight(bound: g.Bound) -> tuple[Decimal, bool]:
    """An upper bound's order: the lower value, exclusive before inclusive, is tighter."""
    return bound[0], not bound[1]


def _plain(value: Decimal) -> str:
    """``value`` as JSON writes it without an exponent: no trailing zeros after the point."""
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


class NumberRules:
    """Number rules, added to ``rules``."""

    def __init__(self, rules: g.RuleSet) -> None:
        self.rules = rules

    def number(self, conj: Conj, path: str, integer: bool) -> str | None:
        """The numbers (integers) the conjunction allows; None: every JSON number."""
        fraction = any(spec.NOT_INTEGER in m for m in conj)  # (a negated "type": "integer")
        if fraction and integer:
            raise NoValue(f"no integer at {path} is a number that is not an integer")
        lows = [b for m in conj if (b := spec.bound(m, "minimum", "exclusiveMinimum"))]
        highs = [b for m in conj if (b := spec.bound(m, "maximum", "exclusiveMaximum"))]
        lo = max(lows) if lows else None
        hi = min(highs, key=lambda b: (b[0], not b[1])) if highs else None
        lo_int = None if lo is None else math.floor(lo[0]) + 1 if lo[1] or lo[0] % 1 else int(lo[0])
        hi_int = None if hi is None else math.ceil(hi[0]) - 1 if hi[1] or hi[0] % 1 else int(hi[0])
        places = g.MAX_PLACES
        steps = [Decimal(str(m["multipleOf"])) for m in conj if "multipleOf" in m]
        if steps and fraction:
            raise UnsupportedSchemaError(
                f"multipleOf at {path} beside a not of type integer is not supported"
            )
        if steps:
            unit, scale = _common_step(steps)
            if integer or scale == 0:  # x is a multiple iff x * 10**scale is one of unit
                return self.multiples(unit // math.gcd(unit, 10**scale), lo_int, hi_int, path)
            if unit != 1:
                return self.decimal_multiples(unit, scale, lo, hi, lo_int, hi_int, path)
            places = scale  # a step of 10**-scale: every number written with <= scale places
        options = []
        if not fraction and (lo_int is None or hi_int is None or lo_int <= hi_int):
            options.append(g.integer_range(lo_int, hi_int))
        if not integer:
            if lo is None and hi is None and not steps and not fraction:
                return None
            low, high = spec.as_float(lo, False), spec.as_float(hi, True)
            if fraction:
                if (lo and lo[0] >= FRACTION_LIMIT) or (hi and hi[0] <= -FRACTION_LIMIT):
                    raise UnsupportedSchemaError(
                        f"numbers that are not integers (a not of type integer) at {path} are "
                        f"written between -{FRACTION_LIMIT} and {FRACTION_LIMIT} only (beyond, "
                        "a double may read them back as integers): these bounds leave none"
                    )
                places = min(places, FRACTION_PLACES)
                low = max(low or (-FRACTION_LIMIT, True), (-FRACTION_LIMIT, True))
                high = min(high or (FRACTION_LIMIT, True), (FRACTION_LIMIT, True), key=_tight)
            with contextlib.suppress(GrammarError):  # no fraction fits: integers only
                options.append(
                    g.decimal_range(
                        self.rules,
                        low,
                        high,
                        need_fraction=True,
                        places=places,
                        nonzero_end=fraction,  # (1.0 is an integer)
                    )
                )
        if not options:
            between = (
                lo is None
                or hi is None
                or lo[0] < hi[0]
                or (lo[0] == hi[0] and not lo[1] and not hi[1])  # (one number: both inclusive)
            )
            if not integer and between:
                # Numbers lie between: none with the places lcgen writes (1e-300 to 2e-300);
                # as for no number, another alternative may still serve.
                raise Unsatisfiable(
                    f"no number between the bounds at {path} has at most "
                    f"{places} decimal places, the most "
                    "lcgen writes: widen the bounds"
                )
            raise NoValue(f"no {'integer' if integer else 'number'} satisfies the bounds at {path}")
        return g.alternatives(options)

    def multiples(self, step: int, lo: int | None, hi: int | None, path: str) -> str:
        """The integers in [lo, hi] that are multiples of ``step``."""
        if lo is not None and hi is not None:
            first, last = -(-lo // step) * step, hi // step * step
            if first > last:
                raise NoValue(f"no multiple of {step} lies within the bounds at {path}")
            if step > 1 and (last - first) // step < MAX_LISTED:
                texts = [str(v) for v in range(first, last + 1, step)]
                return g.trie(texts, self.rules, "multiple")  # a prefix tree: see g.trie
        if step == 1:
            return g.integer_range(lo, hi)
        if hi is None and (lo is None or lo <= 0):  # no bound a multiple could pass
            return self.divisible(step, 0, signed=lo is None, path=path)
        options = []
        if hi is None or hi >= 0:
            options.append(self.natural_multiples(step, max(lo or 0, 0), hi, path))
        if lo is None or lo < 0:
            low = max(1, -hi) if hi is not None else 1
            magnitude = self.natural_multiples(step, low, None if lo is None else -lo, path)
            options.append(f'"-" {magnitude}' if magnitude else None)
        found = [o for o in options if o]
        if not found:
            raise NoValue(f"no multiple of {step} lies within the bounds at {path}")
        return g.alternatives(found)

    def natural_multiples(self, step: int, lo: int, hi: int | None, path: str) -> str | None:
        """The naturals in [lo, hi] that are multiples of ``step``, written canonically (None:
        unbounded, as many digits as other unbounded numbers); None when there are none.
        Digit by digit: a number as long as a bound follows that bound's digits while it is
        tied with them, and the residue mod ``step`` of the digits so far decides where it
        may end (the states: residues times digits still to write, plus one path per bound)."""
        if hi is None:
            hi = 10 ** max(len(str(lo)) + 1, g.MAX_DIGITS) - 1
        if lo > hi:
            return None
        if step * len(str(hi)) > MAX_RANGE_STATES:
            raise UnsupportedSchemaError(
                f"multipleOf {step} with these bounds (at {path}) is not supported"
            )
        rules = self.rules

        def grouped(options: dict[str, list[int]]) -> str:
            """``[digits] rest`` alternatives, one per rest."""
            return " | ".join(f"[{''.join(map(str, ds))}] {rest}" for rest, ds in options.items())

        def live(n: int, r: int) -> bool:
            """Whether n more digits after digits of residue r can end on a multiple: when
            the least such completion fits in n digits."""
            return bool((-r * 10**n) % step < 10**n)

        @functools.cache
        def free(n: int, r: int) -> str:
            """Any ``n`` more digits that end on a multiple, after digits of residue r."""
            if n == 0:
                return '""'
            options: dict[str, list[int]] = {}
            for d in range(10):
                if live(n - 1, nxt := (10 * r + d) % step):
                    options.setdefault(free(n - 1, nxt), []).append(d)
            return rules.add(f"multiple-{r}-{n}", grouped(options))

        def tied(a: str, b: str, i: int, low: bool, high: bool, r: int) -> str | None:
            """The rest of a number of len(a) digits in [a, b], the first i written (residue
            r), still equal to a's first i digits (low) or b's (high)."""
            if not low and not high:
                return free(len(a) - i, r) if live(len(a) - i, r) else None
            if i == len(a):
                return '""' if r == 0 else None
            first, last = int(a[i]) if low else 0, int(b[i]) if high else 9
            options: dict[str, list[int]] = {}
            for d in range(first, last + 1):
                tie = (low and d == first, high and d == last)
                rest = tied(a, b, i + 1, *tie, (10 * r + d) % step)
                if rest is not None:
                    options.setdefault(rest, []).append(d)
            return f"({grouped(options)})" if options else None

        found = []
        for n_digits in range(len(str(lo)), len(str(hi)) + 1):
            a = max(lo, 10 ** (n_digits - 1) if n_digits > 1 else 0)
            b = min(hi, 10**n_digits - 1)
            if a <= b and (expr := tied(str(a), str(b), 0, True, True, 0)) is not None:
                found.append(expr)
        return g.alternatives(found) if found else None

    def decimal_multiples(
        self,
        unit: int,
        scale: int,
        lo: g.Bound | None,
        hi: g.Bound | None,
        lo_int: int | None,
        hi_int: int | None,
        path: str,
    ) -> str:
        """Numbers that are exact multiples of unit / 10**scale, a step that is no power of ten
        (decimal arithmetic, as the specification says: 4.5 is a multiple of 1.5)."""
        step = Decimal(unit).scaleb(-scale)
        if lo is not None and hi is not None:
            first, last = math.ceil(lo[0] / step), math.floor(hi[0] / step)
            if last - first < MAX_LISTED:
                texts = [_plain(n * step) for n in range(first, last + 1)]
                inside = [t for t in texts if spec.within(Decimal(t), lo, hi)]
                if not inside:
                    raise NoValue(f"no multiple of {step} lies within the bounds at {path}")
                return g.trie(inside, self.rules, "multiple")  # a prefix tree: see g.trie
        if hi is None and (lo is None or lo[0] < 0 or lo == (Decimal(0), False)):
            return self.divisible(unit, scale, signed=lo is None, path=path)
        # Bounded on both sides with too many multiples to list: the integer ones (fewer).
        try:
            return self.multiples(unit // math.gcd(unit, 10**scale), lo_int, hi_int, path)
        except GrammarError:
            raise UnsupportedSchemaError(
                f"multipleOf {step} with these bounds (at {path}) is not supported"
            ) from None

    def divisible(self, unit: int, scale: int, signed: bool, path: str) -> str:
        """Texts ``-?int(.digits)?`` (at most ``scale`` digits after the point) whose value
        times 10**scale is a multiple of ``unit``, digit by digit: the state is the value of
        the digits so far mod ``unit`` and how many of them follow the point (None: none yet)."""
        if unit * (scale + 1) > MAX_STEP_STATES:
            raise UnsupportedSchemaError(
                f"multipleOf {Decimal(unit).scaleb(-scale)} at {path} is not supported"
            )
        names: dict[tuple[int, int | None], str] = {}

        def ends(r: int, after: int | None) -> bool:
            return after != 0 and r * 10 ** (scale - (after or 0)) % unit == 0

        @functools.cache
        def live(r: int, after: int | None) -> bool:
            if after is None or ends(r, after):
                return True  # the integer part can always grow to a multiple
            return after < scale and any(live((10 * r + d) % unit, after + 1) for d in range(10))

        def state(r: int, after: int | None) -> str:
            if (r, after) not in names:
                names[r, after] = self.rules.reserve(f"multiple-{r}")
                options = digits(r, after, range(10)) if after is None or after < scale else []
                if after is None and scale and live(r, 0):
                    options.append(f'"." {state(r, 0)}')
                if ends(r, after):
                    options.append('""')
                self.rules.define(names[r, after], " | ".join(options))
            return names[r, after]

        def digits(r: int, after: int | None, allowed: range) -> list[str]:
            """One more digit: grouped by the state it leads to."""
            step = None if after is None else after + 1
            targets: dict[int, list[int]] = {}
            for d in allowed:
                if live(nxt := (10 * r + d) % unit, step):
                    targets.setdefault(nxt, []).append(d)
            return [f"[{''.join(map(str, ds))}] {state(n, step)}" for n, ds in targets.items()]

        zero = f' ("." {state(0, 0)})?' if scale else ""
        first = g.alternatives(digits(0, None, range(1, 10)))
        sign = '"-"? ' if signed else ""
        return f'{sign}("0"{zero} | {first})'  # "-0" too: zero is a multiple
