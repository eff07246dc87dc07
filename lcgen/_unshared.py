"""Objects that own native resources (a KV slot, a context, the weights) refuse to be copied or
pickled, saying what to do instead: ``copy.copy`` of a sequence made a second object on the
same slot and tokens, and generating on one broke the other."""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn


class Unshared:
    """A mixin: ``copy.copy``, ``copy.deepcopy`` and ``pickle`` raise a TypeError naming
    :attr:`instead`."""

    __slots__ = ()
    instead: ClassVar[str] = ""

    def _refuse(self, what: str) -> NoReturn:
        raise TypeError(f"a {type(self).__name__} cannot be {what}: {self.instead}")

    def __copy__(self) -> NoReturn:
        self._refuse("copied")

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        self._refuse("copied")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        self._refuse("pickled")
