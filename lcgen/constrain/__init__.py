"""Constraints: :class:`Grammar` (what output is allowed) and :class:`GrammarState` (where one
sequence is in it), with the compilers to GBNF from regular expressions (:mod:`.regex`) and
JSON Schema (:mod:`.json_schema`)."""

from lcgen.constrain.bundle import bundle_schema
from lcgen.constrain.grammar import Grammar, GrammarState

__all__ = ["Grammar", "GrammarState", "bundle_schema"]
