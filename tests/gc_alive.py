"""What is still alive, for the tests that check an answer frees its memory: objects tracked by the collector, with
the cyclic collector off (`no_collector` in conftest.py), so what a reference cycle holds counts as alive."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Set
from typing import Any


def alive(kind: type) -> list[Any]:
    """Tracked objects of exactly `kind`."""
    return [o for o in gc.get_objects() if type(o) is kind]


class AliveSince:
    """The objects of `kind` alive when made (other tests' engines' prefix blocks, say); `new` lists those alive
    since (weak references, so an id reused by a new object is not mistaken for an old one)."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self._before = {id(o): weakref.ref(o) for o in alive(kind)}

    def new(self, besides: Set[int] = frozenset()) -> list[Any]:
        """Objects of `kind` made since, other than those whose id is in `besides`."""
        return [o for o in alive(self.kind) if id(o) not in besides and not self._known(o)]

    def _known(self, thing: object) -> bool:
        ref = self._before.get(id(thing))
        return ref is not None and ref() is thing
