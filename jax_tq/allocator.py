"""Host-side page allocation for paged KV caches: which physical pages of a pool each sequence owns,
and the int32 block tables the ops take.

Pure Python / NumPy, no JAX: a serving loop keeps one :class:`PageAllocator` per cache pool (one
for all layers, since every layer's pool has the same pages) and hands
:meth:`PageAllocator.block_tables` to :func:`jax_tq.slot_mapping`, :func:`jax_tq.write_cache`,
:func:`jax_tq.paged_decode`, :func:`jax_tq.paged_prefill`, :func:`jax_tq.prompt_attention` and
:func:`jax_tq.ragged_paged_attention`.

Unused table entries are :data:`PageAllocator.UNUSED` (-1), never a real page: for a position that
an entry of -1 covers, :func:`jax_tq.slot_mapping` gives slot -1, which :func:`jax_tq.write_cache`
skips, and the attention ops read no tokens from it (with a window, a sequence's last ``window``
positions come from its ring, where the serving ops still write a live token whose page is
missing). A 0 there would be page 0, owned by some other sequence: a position run
past a sequence's pages would overwrite that sequence's token.
"""
from __future__ import annotations

import heapq
from typing import Hashable, Iterable

import numpy as np

__all__ = ["OutOfPagesError", "PageAllocator"]


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than a request needs; nothing was allocated.

    Attributes:
      needed: pages the request needed; free: pages free when it was made.
    """

    def __init__(self, message: str, needed: int, free: int):
        super().__init__(message)
        self.needed = needed
        self.free = free


def _count(value, name: str, where: str, least: int = 0) -> int:
    """``value`` as a Python int >= ``least``: TypeError unless an int (not bool), ValueError below."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"PageAllocator.{where}: {name} must be an int, got {value!r}")
    if value < least:
        raise ValueError(f"PageAllocator.{where}: {name} must be >= {least}, got {value}")
    return int(value)


def _hashable(seq_id, where: str):
    """``seq_id`` itself; TypeError naming it where it cannot key the allocator's tables."""
    try:
        hash(seq_id)
    except TypeError:
        raise TypeError(f"PageAllocator.{where}: seq_id must be hashable (an int or str request id), "
                        f"got {type(seq_id).__name__}") from None
    return seq_id


class PageAllocator:
    """Owner of a pool of ``num_pages`` pages of ``page_size`` tokens: gives each sequence the pages
    its tokens need, at most ``max_pages_per_seq``, and takes them back.

    Free pages are handed out lowest index first (a heap): a freed page is reused before any
    higher one, and allocation is deterministic. Every method leaves the allocator as it was when
    it raises.

    Args:
      num_pages: pages in the pool (``cache.num_pages``), an int >= 1.
      page_size: tokens per page (``cache.page_size``), an int >= 1.
      max_pages_per_seq: the block tables' width (pages one sequence may own), an int >= 1.
    Raises:
      TypeError: an argument that is not an int (bools refused).
      ValueError: an argument < 1; num_pages * page_size slots past int32 (the ops' slot indices).

    Example::

        alloc = PageAllocator(num_pages=64, page_size=16, max_pages_per_seq=8)
        alloc.allocate("a", 40)              # 3 pages
        alloc.extend("a", 49)                # a 4th page
        tables = alloc.block_tables(["a"])   # int32 [1, 8], -1 past the 4 pages
        alloc.free("a")
    """

    #: The block-table entry of a page a sequence does not own (slot_mapping maps it to -1).
    UNUSED = -1

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("max_pages_per_seq", max_pages_per_seq)):
            _count(value, name, "__init__", least=1)
        if int(num_pages) * int(page_size) > np.iinfo(np.int32).max:
            raise ValueError(f"PageAllocator: num_pages * page_size = {int(num_pages) * int(page_size)} slots "
                             f"exceed int32 (the ops' slot indices)")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.max_pages_per_seq = int(max_pages_per_seq)
        self._free = list(range(self.num_pages))  # a heap (sorted is one)
        self._pages: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}

    # ----------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages not owned by any sequence."""
        return len(self._free)

    @property
    def seq_ids(self) -> list:
        """The sequences that hold pages (or were allocated 0 tokens), in allocation order."""
        return list(self._pages)

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._pages
        except TypeError:  # an unhashable value is no allocated id
            return False

    def __len__(self) -> int:
        return len(self._pages)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens occupy: ``ceil(num_tokens / page_size)``. TypeError:
        ``num_tokens`` not an int; ValueError: negative."""
        return -(-_count(num_tokens, "num_tokens", "pages_for") // self.page_size)

    def pages(self, seq_id) -> list[int]:
        """The physical pages of ``seq_id``, in logical order (a copy). KeyError: unknown ``seq_id``;
        TypeError: an unhashable one."""
        return list(self._pages[self._known(seq_id, "pages")])

    def num_tokens(self, seq_id) -> int:
        """The token count ``seq_id`` was last allocated or extended to. KeyError: unknown ``seq_id``;
        TypeError: an unhashable one."""
        return self._tokens[self._known(seq_id, "num_tokens")]

    def capacity(self, seq_id) -> int:
        """Tokens ``seq_id``'s pages hold: ``len(pages) * page_size``. KeyError: unknown ``seq_id``;
        TypeError: an unhashable one."""
        return len(self._pages[self._known(seq_id, "capacity")]) * self.page_size

    # ----------------------------------------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Give a new sequence the pages of its first ``num_tokens`` tokens.

        Args:
          seq_id: any hashable id not allocated yet (e.g. an int request id).
          num_tokens: int >= 0 (0: the sequence owns no pages yet; :meth:`extend` adds them).
        Returns:
          the sequence's physical pages (``ceil(num_tokens / page_size)`` of them, lowest free first).
        Raises:
          ValueError: ``seq_id`` already allocated (free it first), or more pages than
            ``max_pages_per_seq``.
          TypeError / ValueError: ``num_tokens`` not an int / negative.
          TypeError: ``seq_id`` not hashable.
          OutOfPagesError: fewer free pages than needed (``needed`` and ``free`` attributes).
        """
        if _hashable(seq_id, "allocate") in self._pages:
            raise ValueError(f"PageAllocator.allocate: seq_id {seq_id!r} is already allocated "
                             f"({len(self._pages[seq_id])} pages); extend() it or free() it first")
        num_tokens = _count(num_tokens, "num_tokens", "allocate")
        new = self._take(seq_id, 0, num_tokens, "allocate")
        self._pages[seq_id] = new
        self._tokens[seq_id] = num_tokens
        return list(new)

    def extend(self, seq_id, new_total_tokens: int) -> list[int]:
        """Grow ``seq_id`` to ``new_total_tokens`` tokens, adding the pages they need.

        Args:
          seq_id: an allocated sequence.
          new_total_tokens: its new token count, an int >= its current count.
        Returns:
          the pages added (possibly none), lowest free first.
        Raises:
          KeyError: unknown ``seq_id``.
          TypeError: ``new_total_tokens`` not an int, or ``seq_id`` not hashable.
          ValueError: ``new_total_tokens`` below the current count (pages are not shrunk; free
            the sequence instead), or more pages than ``max_pages_per_seq``.
          OutOfPagesError: fewer free pages than needed; the sequence keeps its pages.
        """
        self._known(seq_id, "extend")
        total = _count(new_total_tokens, "new_total_tokens", "extend")
        if total < self._tokens[seq_id]:
            raise ValueError(f"PageAllocator.extend: new_total_tokens={total} is below seq_id {seq_id!r}'s "
                             f"{self._tokens[seq_id]} tokens (extend only grows a sequence)")
        new = self._take(seq_id, len(self._pages[seq_id]), total, "extend")
        self._pages[seq_id].extend(new)
        self._tokens[seq_id] = total
        return list(new)

    def free(self, seq_id) -> list[int]:
        """Return ``seq_id``'s pages to the pool and forget it. Returns the freed pages.
        KeyError: unknown ``seq_id`` (also on a second free); TypeError: an unhashable one."""
        self._known(seq_id, "free")
        pages = self._pages.pop(seq_id)
        del self._tokens[seq_id]
        for p in pages:
            heapq.heappush(self._free, p)
        return pages

    def block_tables(self, seq_ids: Iterable) -> np.ndarray:
        """The block tables of ``seq_ids``: int32 ``[len(seq_ids), max_pages_per_seq]``, row i holding
        ``seq_ids[i]``'s pages in logical order, then :data:`UNUSED` (-1).

        Raises:
          KeyError: an unknown seq_id.
          TypeError: an unhashable one.
        """
        seq_ids = list(seq_ids)
        tables = np.full((len(seq_ids), self.max_pages_per_seq), self.UNUSED, np.int32)
        for row, seq_id in enumerate(seq_ids):
            pages = self._pages[self._known(seq_id, "block_tables")]
            tables[row, :len(pages)] = pages
        return tables

    # ----------------------------------------------------------------------------------------
    def _known(self, seq_id, where: str):
        if _hashable(seq_id, where) not in self._pages:
            raise KeyError(f"PageAllocator.{where}: unknown seq_id {seq_id!r} (not allocated, or freed)")
        return seq_id

    def _take(self, seq_id, have: int, num_tokens: int, where: str) -> list[int]:
        """Pop the pages beyond ``have`` that ``num_tokens`` tokens need (checks first, then takes)."""
        want = -(-num_tokens // self.page_size)
        if want > self.max_pages_per_seq:
            raise ValueError(f"PageAllocator.{where}: seq_id {seq_id!r} with {num_tokens} tokens needs {want} pages "
                             f"of {self.page_size}, more than max_pages_per_seq={self.max_pages_per_seq}")
        needed = max(want - have, 0)
        if needed > len(self._free):
            raise OutOfPagesError(f"PageAllocator.{where}: seq_id {seq_id!r} needs {needed} more page(s) for "
                                  f"{num_tokens} tokens but only {len(self._free)} of {self.num_pages} are free",
                                  needed, len(self._free))
        return [heapq.heappop(self._free) for _ in range(needed)]

    def __repr__(self) -> str:
        return (f"PageAllocator(num_pages={self.num_pages}, page_size={self.page_size}, max_pages_per_seq="
                f"{self.max_pages_per_seq}, sequences={len(self._pages)}, free_pages={self.free_pages})")
