"""Live KV: the context and its slots, sequences (checkpoints, rewinds, forks, the saved-file
format), runs (plain and backtracking) and the one :class:`Scheduler` that steps them."""

from lcgen.runtime.backtrack import Backtracker
from lcgen.runtime.checkpoint import Checkpoint, SequenceStats
from lcgen.runtime.context import Context
from lcgen.runtime.drafts import check_draft_model
from lcgen.runtime.run import PlainRun, Run
from lcgen.runtime.scheduler import Event, Scheduler
from lcgen.runtime.sequence import Sequence

__all__ = [
    "Backtracker",
    "Checkpoint",
    "Context",
    "Event",
    "PlainRun",
    "Run",
    "Scheduler",
    "Sequence",
    "SequenceStats",
    "check_draft_model",
]
