"""The one home of the host-side caches, and their one invalidation rule.

Small batches are host-bound: their pace is the Python and launch work per call, so the
package remembers that work by signature. Every such memo is a :class:`HostCache` made here
(by name), bounded (emptied whole when full: a model has a handful of signatures).

The rule: a cache's key holds everything per call that its value depends on (dtypes, shapes,
strides, alignments, flags, devices, and the forced block-kernel variant where the value
depends on it: block plans and remembered forward launches). Everything else a value depends
on is process state that changes only through functions that call :func:`clear_all`:
registering a backend (``dispatch.register_backend``). Tests that patch such state call it too.

The caches, by name: the validated calls of ``block_attention`` (``checked_calls``), the
dispatcher's backend choices (``backend_choices``), the block kernels' launch plans
(``block_plans``), forward launches remembered by signature (``block_forwards``), the prepared
backward's templates (``block_backwards``), and each kernel launcher's compiled entries
(``launcher:<kernel>``).
"""
from __future__ import annotations

from typing import Hashable, List

_CACHES: List["HostCache"] = []


class HostCache(dict):
    """A bounded memo of host-side work (a ``dict``: lookups stay C calls)."""

    __slots__ = ("name", "max_entries")

    def __init__(self, name: str, max_entries: int = 256):
        super().__init__()
        self.name, self.max_entries = name, max_entries
        _CACHES.append(self)

    def put(self, key: Hashable, value):
        """Store ``value`` under ``key`` (emptying the cache first when it is full); returns ``value``."""
        if len(self) >= self.max_entries:
            self.clear()
        self[key] = value
        return value


def clear_all() -> None:
    """Forget every cached entry (the invalidation rule of the module docstring)."""
    for cache in _CACHES:
        cache.clear()

