"""A pure-Python model of PyTorch's CUDA caching allocator, for replaying a training step.

Peak GPU memory of a training step is not the peak of live tensor bytes: PyTorch rounds every
request, carves requests out of cached *segments*, and never gives a segment back to the device
unless an allocation would otherwise fail. ``torch.cuda.max_memory_reserved()`` -- what
``nvidia-smi`` and an out-of-memory error see -- is therefore a property of the order of
allocations and frees, not only of their sizes. This module reproduces that behaviour so that a
stream of allocations and frees recorded from a simulated (fake-tensor) step can be turned into
the allocated / reserved peaks a real GPU would show, without a GPU and without importing torch.

It follows ``c10/cuda/CUDACachingAllocator.cpp`` in its default configuration: no expandable
segments, ``max_split_size`` unlimited, no ``roundup_power2_divisions``, no garbage-collection
threshold, a single stream (so a freed block is reusable at once), no CUDA-graph pools. Names
of the C++ functions are given where a piece of the model corresponds to one.

Two deliberate simplifications, both documented where they apply:

* a segment allocation (``cudaMalloc``) fails exactly when it would push the reserved bytes
  above ``capacity_bytes`` (the allocator's ``set_per_process_memory_fraction`` check); the CUDA
  context, other processes and driver fragmentation are not modelled;
* ``malloc(0)`` is rounded to a 512-byte block as ``round_size`` does. Note that PyTorch's
  ``allocate()`` short-circuits zero-byte requests (the tensor gets a null pointer and no block),
  so a recorder that wants exact figures should leave zero-byte allocations out of the stream.

Events for :func:`replay` are tuples ``(ALLOC, id, nbytes, category)`` and ``(FREE, id)``; ids
are any hashable values (an id may be reused once it has been freed), categories are strings
used for the breakdown at the peak (``"param"``, ``"activation"``, ...).
"""

from __future__ import annotations

import gc
import operator
from bisect import bisect_left, insort
from dataclasses import dataclass

__all__ = [
    "ALLOC",
    "FREE",
    "Allocator",
    "Block",
    "OutOfMemory",
    "ReplayResult",
    "allocation_size",
    "min_capacity_bytes",
    "replay",
    "replay_with_min_capacity",
    "round_size",
]

ALLOC, FREE = "alloc", "free"

# Constants of CUDACachingAllocator.cpp (names as there).
K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20  # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20  # "small" allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20 << 20  # allocations between 1 and 10 MiB may use 20 MiB segments
K_MIN_LARGE_ALLOC = 10 << 20  # allocations of 10 MiB or more get a segment of their own size...
K_ROUND_LARGE = 2 << 20  # ...rounded up to a multiple of 2 MiB


def round_size(nbytes: int) -> int:
    """Block size for a request (``round_size``): a multiple of 512 bytes, at least 512."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return (nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """Size of the new segment for a rounded request no cached block can serve
    (``get_allocation_size``): 2 MiB for the small pool, 20 MiB below 10 MiB, else the request
    rounded up to 2 MiB."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


class OutOfMemory(Exception):
    """An allocation could not be served within the capacity, even after releasing every cached
    segment that was entirely free (the point where PyTorch raises ``OutOfMemoryError``)."""


class Block:
    """A contiguous range of a segment, allocated or free (``Block`` in the C++ source).

    ``malloc`` returns one as the handle to pass back to ``free``. A handle is only valid until
    it is freed: the allocator reuses block objects (a freed block absorbs its free neighbours
    and may be handed out again), as the C++ allocator reuses its ``Block`` structs.
    """

    __slots__ = ("size", "segment", "offset", "small", "allocated", "requested", "category", "prev", "next", "key")

    def __init__(self, size, segment, offset, small):
        self.size = size  # bytes this block spans (what allocated_bytes counts)
        self.segment = segment  # id of the segment, in creation order
        self.offset = offset  # byte offset of the block within its segment
        self.small = small  # True for the small pool
        self.allocated = False
        self.requested = 0  # the unrounded request, while allocated
        self.category = None
        self.prev = None  # neighbours within the segment (by address)
        self.next = None
        self.key = None  # (size, segment, offset, self) while in a free pool (stale otherwise)

    def __repr__(self):
        state = "allocated" if self.allocated else "free"
        return (
            f"Block(size={self.size}, segment={self.segment}, offset={self.offset}, "
            f"{'small' if self.small else 'large'}, {state})"
        )


class Allocator:
    """The stateful allocator model: ``malloc`` / ``free`` plus the statistics PyTorch keeps.

    Free blocks of each pool are kept in a list of ``(size, segment, offset, block)`` tuples
    sorted with ``bisect``; that is the C++ ``BlockPool`` set ordered by (stream, size, address),
    with (segment id, offset) standing in for the address so that best fit breaks ties
    deterministically (lowest segment, then lowest offset).

    Statistics mirror ``torch.cuda.memory_stats``: ``allocated_bytes`` counts block sizes
    (rounded, and whole blocks where no split happened), ``requested_bytes`` the unrounded
    requests, ``reserved_bytes`` the segments. Peaks are kept from construction on;
    ``breakdown_at_peak`` is the per-category allocated bytes the first time the allocated peak
    was reached (kept only if ``track_breakdown``, since copying it costs time in a search).
    """

    def __init__(self, capacity_bytes: int | None = None, *, track_breakdown: bool = True):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._small_pool = []  # sorted free blocks of the small pool
        self._large_pool = []  # sorted free blocks of the large pool
        self._segments = {}  # segment id -> its first block (offset 0)
        self._segment_sizes = {}  # segment id -> size
        self._next_segment = 0
        self._allocated = 0
        self._requested = 0
        self._reserved = 0
        self._free_segment_bytes = 0  # bytes of segments that are entirely free
        self._segment_log = None  # a search's log: (reserved, size, releasable) per segment
        self.allocated_peak_bytes = 0
        self.requested_peak_bytes = 0
        self.reserved_peak_bytes = 0
        self.n_segments_peak = 0
        self._track = track_breakdown
        self._by_category = {}  # category -> allocated block bytes now
        self.breakdown_at_peak = {}

    # -- statistics ------------------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """Sum of the sizes of allocated blocks (PyTorch's ``allocated_bytes.all.current``)."""
        return self._allocated

    @property
    def requested_bytes(self) -> int:
        """Sum of the unrounded requests of allocated blocks (``requested_bytes.all.current``)."""
        return self._requested

    @property
    def reserved_bytes(self) -> int:
        """Sum of the sizes of the segments held (``reserved_bytes.all.current``)."""
        return self._reserved

    @property
    def releasable_bytes(self) -> int:
        """Bytes of the segments that are entirely free: what ``release_cached`` would return."""
        return self._free_segment_bytes

    @property
    def n_segments(self) -> int:
        """Number of segments held (``segment.all.current``)."""
        return len(self._segment_sizes)

    def allocated_by_category(self) -> dict:
        """Allocated block bytes per category, now (only kept if ``track_breakdown``)."""
        return {c: n for c, n in self._by_category.items() if n}

    def segments(self) -> list:
        """The segments as ``(segment id, size, is_small, [blocks by address])``, for inspection."""
        out = []
        for seg, head in self._segments.items():
            blocks, b = [], head
            while b is not None:
                blocks.append(b)
                b = b.next
            out.append((seg, self._segment_sizes[seg], head.small, blocks))
        return out

    # -- allocation --------------------------------------------------------------------------

    def malloc(self, nbytes: int, category: str = "other") -> Block:
        """Allocate ``nbytes`` and return the block handle (``DeviceCachingAllocator::malloc``).

        Raises :class:`OutOfMemory` if no cached block fits and a new segment does not fit in
        the capacity even after releasing the entirely free cached segments; as in PyTorch,
        those segments stay released, and nothing else has changed."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        size = K_MIN_BLOCK_SIZE if nbytes < K_MIN_BLOCK_SIZE else (nbytes + 511) & ~511
        small = size <= K_SMALL_SIZE
        pool = self._small_pool if small else self._large_pool
        # get_free_block: best fit, the first free block of at least `size` in (size, addr) order
        i = bisect_left(pool, (size,))
        if i < len(pool):
            block = pool.pop(i)[3]
            if block.prev is None and block.next is None:  # a whole cached segment
                self._free_segment_bytes -= block.size
        else:
            block = self._new_segment(size, small)
        # alloc_found_block / should_split: the remainder becomes a free block of its own only if
        # it is worth it; otherwise the whole block is handed out (and counted as allocated)
        remaining = block.size - size
        if remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE:
            rest = Block(remaining, block.segment, block.offset + size, small)
            rest.prev = block
            nxt = rest.next = block.next
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = size
            rest.key = key = (remaining, rest.segment, rest.offset, rest)
            insort(pool, key)
        block.allocated = True
        block.requested = nbytes
        block.category = category
        requested = self._requested = self._requested + nbytes
        if requested > self.requested_peak_bytes:
            self.requested_peak_bytes = requested
        size = block.size
        allocated = self._allocated = self._allocated + size
        if self._track:
            by_cat = self._by_category
            by_cat[category] = by_cat.get(category, 0) + size
            if allocated > self.allocated_peak_bytes:
                self.allocated_peak_bytes = allocated
                self.breakdown_at_peak = by_cat.copy()
        elif allocated > self.allocated_peak_bytes:
            self.allocated_peak_bytes = allocated
        return block

    def _new_segment(self, size: int, small: bool) -> Block:
        """``alloc_block``, with the out-of-memory fallback of ``malloc``: when the new segment
        does not fit in the capacity, release the entirely free cached segments
        (``release_cached_blocks``) and try once more."""
        seg_size = allocation_size(size)
        if self._segment_log is not None:
            self._segment_log.append((self._reserved, seg_size, self._free_segment_bytes))
        cap = self.capacity_bytes
        if cap is not None and self._reserved + seg_size > cap:
            self.release_cached()
            if self._reserved + seg_size > cap:
                raise OutOfMemory(
                    f"cannot allocate a {seg_size}-byte segment for a {size}-byte block: "
                    f"{self._reserved} bytes reserved ({self._allocated} allocated), "
                    f"capacity {cap}"
                )
        seg = self._next_segment
        self._next_segment = seg + 1
        block = Block(seg_size, seg, 0, small)
        self._segments[seg] = block
        self._segment_sizes[seg] = seg_size
        self._reserved += seg_size
        if self._reserved > self.reserved_peak_bytes:
            self.reserved_peak_bytes = self._reserved
        if len(self._segment_sizes) > self.n_segments_peak:
            self.n_segments_peak = len(self._segment_sizes)
        return block

    def release_cached(self) -> int:
        """Give every entirely free segment back to the device, in both pools
        (``release_cached_blocks``, i.e. ``torch.cuda.empty_cache()``); return the bytes released.

        A segment is entirely free when one free block spans it (no neighbours): free blocks
        always merge, so a segment with no allocated block is a single free block."""
        released = 0
        for pool in (self._large_pool, self._small_pool):
            keep = []
            for entry in pool:
                block = entry[3]
                if block.prev is None and block.next is None:
                    released += block.size
                    del self._segments[block.segment]
                    del self._segment_sizes[block.segment]
                    block.key = None
                else:
                    keep.append(entry)
            pool[:] = keep  # in place: malloc holds a reference to the pool
        self._reserved -= released
        self._free_segment_bytes -= released
        return released

    def free(self, block: Block) -> None:
        """Return a block to its pool, merging it with free neighbours of the same segment
        (``free_block`` / ``try_merge_blocks``). The segment stays reserved (cached)."""
        if not block.allocated:
            raise ValueError(f"{block!r} is not allocated (double free?)")
        block.allocated = False
        size = block.size
        self._allocated -= size
        self._requested -= block.requested
        if self._track:
            self._by_category[block.category] -= size
        block.requested = 0
        block.category = None
        pool = self._small_pool if block.small else self._large_pool
        prev = block.prev
        if prev is not None and not prev.allocated:
            del pool[bisect_left(pool, prev.key)]
            block.offset = prev.offset
            size += prev.size
            pp = block.prev = prev.prev
            if pp is None:
                self._segments[block.segment] = block
            else:
                pp.next = block
            prev.key = prev.prev = prev.next = None  # dropped: break its reference cycles
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            del pool[bisect_left(pool, nxt.key)]
            size += nxt.size
            nn = block.next = nxt.next
            if nn is not None:
                nn.prev = block
            nxt.key = nxt.prev = nxt.next = None
        block.size = size
        block.key = key = (size, block.segment, block.offset, block)
        insort(pool, key)
        if block.prev is None and block.next is None:  # the whole segment is free now
            self._free_segment_bytes += size


# -- replay ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay` measured; all peaks cover the events up to the failing one."""

    allocated_peak_bytes: int  # max of the sum of allocated block sizes (rounded / unsplit)
    reserved_peak_bytes: int  # max of the sum of segment sizes (max_memory_reserved)
    requested_peak_bytes: int  # max of the sum of the unrounded requests
    # category -> allocated block bytes when the allocated peak was first reached (categories
    # holding nothing then are left out); the values sum to allocated_peak_bytes
    breakdown_at_peak: dict
    oom: bool  # an allocation could not be served within the capacity
    oom_event_index: int | None  # index of the failing event; the replay stopped there
    n_segments_peak: int  # most segments held at once


def _validate(events) -> list:
    """Check the whole stream before replaying it, so that a mistake in the recorder is reported
    even when a replay would stop early at an out-of-memory; returns the events as a list."""
    events = list(events)
    live = set()
    for index, event in enumerate(events):
        try:
            kind = event[0]
            n = len(event)
        except TypeError:
            raise ValueError(f"event {index}: not a tuple: {event!r}") from None
        if kind == ALLOC:
            if n != 4:
                raise ValueError(f"event {index}: expected (ALLOC, id, nbytes, category), got {event!r}")
            _, ident, nbytes, _ = event
            if type(nbytes) is not int:
                try:
                    if isinstance(nbytes, bool):
                        raise TypeError
                    nbytes = operator.index(nbytes)  # an integer type such as numpy's
                except TypeError:
                    raise ValueError(f"event {index}: size must be an int, got {nbytes!r}") from None
                events[index] = (ALLOC, ident, nbytes, event[3])  # our copy, plain int
            if nbytes < 0:
                raise ValueError(f"event {index}: negative size {nbytes} for id {ident!r}")
            try:
                if ident in live:
                    raise ValueError(f"event {index}: id {ident!r} allocated twice (it is still live)")
            except TypeError:
                raise ValueError(f"event {index}: id {ident!r} is not hashable") from None
            live.add(ident)
        elif kind == FREE:
            if n != 2:
                raise ValueError(f"event {index}: expected (FREE, id), got {event!r}")
            ident = event[1]
            try:
                live.remove(ident)
            except (KeyError, TypeError):
                raise ValueError(
                    f"event {index}: free of unknown id {ident!r} (never allocated, or already freed)"
                ) from None
        else:
            raise ValueError(f"event {index}: unknown event kind {kind!r}")
    return events


def _run(events: list, capacity_bytes, track_breakdown: bool, segment_log=None) -> ReplayResult:
    """Replay already validated events; ``segment_log``, a list, receives
    ``(event index, reserved before, segment size, releasable bytes)`` for each segment
    created."""
    allocator = Allocator(capacity_bytes, track_breakdown=track_breakdown)
    malloc, free = allocator.malloc, allocator.free
    live = {}
    oom_index = None
    if segment_log is not None:  # (no capacity: a search's unlimited replay)
        created = allocator._segment_log = []
        for index, event in enumerate(events):
            if event[0] == ALLOC:
                known = len(created)
                live[event[1]] = malloc(event[2], event[3])
                if len(created) != known:  # malloc creates at most one segment
                    segment_log.append((index, *created[-1]))
            else:
                free(live.pop(event[1]))
        allocator._segment_log = None
    else:
        for index, event in enumerate(events):
            if event[0] == ALLOC:
                try:
                    live[event[1]] = malloc(event[2], event[3])
                except OutOfMemory:
                    oom_index = index
                    break
            else:
                free(live.pop(event[1]))
    return ReplayResult(
        allocated_peak_bytes=allocator.allocated_peak_bytes,
        reserved_peak_bytes=allocator.reserved_peak_bytes,
        requested_peak_bytes=allocator.requested_peak_bytes,
        breakdown_at_peak={c: n for c, n in allocator.breakdown_at_peak.items() if n},
        oom=oom_index is not None,
        oom_event_index=oom_index,
        n_segments_peak=allocator.n_segments_peak,
    )


def _advance(
    allocator: Allocator, live: dict, events: list, start: int, stop: int, segment_log=None, above=None
) -> int:
    """Replays ``events[start:stop]`` on an allocator without a capacity, as ``malloc`` and
    ``free`` would (the same blocks, pools and segments) but keeping none of the statistics a
    search does not read (allocated and requested bytes, peaks, categories); ``segment_log``
    receives ``(event index, reserved before, segment size, releasable bytes)`` for each
    segment created. With ``above``, stops after the first segment that takes the reserved
    bytes above it. Returns the index of the next event to replay. Inlined: a search replays
    hundreds of thousands of events."""
    small_pool, large_pool = allocator._small_pool, allocator._large_pool
    new_segment = allocator._new_segment
    created = allocator._segment_log = [] if segment_log is not None else None
    try:
        for index in range(start, stop):
            event = events[index]
            if event[0] == ALLOC:
                nbytes = event[2]
                size = K_MIN_BLOCK_SIZE if nbytes < K_MIN_BLOCK_SIZE else (nbytes + 511) & ~511
                small = size <= K_SMALL_SIZE
                pool = small_pool if small else large_pool
                i = bisect_left(pool, (size,))
                if i < len(pool):
                    block = pool.pop(i)[3]
                    if block.prev is None and block.next is None:
                        allocator._free_segment_bytes -= block.size
                else:
                    block = new_segment(size, small)
                    if created is not None:
                        entry = created[-1]
                        segment_log.append((index, *entry))
                        if above is not None and entry[0] + entry[1] > above:
                            stop = index + 1  # (this event is finished below)
                remaining = block.size - size
                if remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE:
                    rest = Block(remaining, block.segment, block.offset + size, small)
                    rest.prev = block
                    nxt = rest.next = block.next
                    if nxt is not None:
                        nxt.prev = rest
                    block.next = rest
                    block.size = size
                    rest.key = key = (remaining, rest.segment, rest.offset, rest)
                    insort(pool, key)
                block.allocated = True
                live[event[1]] = block
            else:
                block = live.pop(event[1])
                block.allocated = False
                size = block.size
                pool = small_pool if block.small else large_pool
                prev = block.prev
                if prev is not None and not prev.allocated:
                    del pool[bisect_left(pool, prev.key)]
                    block.offset = prev.offset
                    size += prev.size
                    pp = block.prev = prev.prev
                    if pp is None:
                        allocator._segments[block.segment] = block
                    else:
                        pp.next = block
                    prev.key = prev.prev = prev.next = None
                nxt = block.next
                if nxt is not None and not nxt.allocated:
                    del pool[bisect_left(pool, nxt.key)]
                    size += nxt.size
                    after = block.next = nxt.next
                    if after is not None:
                        after.prev = block
                    nxt.key = nxt.prev = nxt.next = None
                block.size = size
                block.key = key = (size, block.segment, block.offset, block)
                insort(pool, key)
                if block.prev is None and block.next is None:
                    allocator._free_segment_bytes += size
            if index + 1 == stop:
                return stop
        return stop
    finally:
        allocator._segment_log = None


def _clone(allocator: Allocator, live: dict) -> tuple:
    """A copy of an allocator's state (blocks, pools, counters) and of the live id -> block
    map, for replaying on from there (a search allocator: no breakdown kept)."""
    new = Allocator.__new__(Allocator)
    new.__dict__.update(allocator.__dict__)
    new._segment_log = None
    new._track = False
    new._by_category = {}
    new.breakdown_at_peak = {}
    copies = {}
    segments = {}
    for seg, head in allocator._segments.items():
        previous = None
        block = head
        while block is not None:
            twin = Block(block.size, block.segment, block.offset, block.small)
            twin.allocated = block.allocated
            twin.requested = block.requested
            twin.category = block.category
            twin.prev = previous
            if previous is None:
                segments[seg] = twin
            else:
                previous.next = twin
            if not block.allocated:
                twin.key = (twin.size, twin.segment, twin.offset, twin)
            copies[id(block)] = twin
            previous = twin
            block = block.next
    new._segments = segments
    new._segment_sizes = dict(allocator._segment_sizes)
    # (size, segment, offset) are unique: the copies sort as the originals
    new._small_pool = [copies[id(entry[3])].key for entry in allocator._small_pool]
    new._large_pool = [copies[id(entry[3])].key for entry in allocator._large_pool]
    return new, {ident: copies[id(block)] for ident, block in live.items()}


class _Continuation:
    """The replay from a state (``start``: allocator and live map, at event ``index``) on an
    unlimited allocator, described by its segment log ``[(event index, reserved before,
    segment size, releasable)]``: what a capacity-limited replay in the same state does until
    its next refusal. The log is extended only as far as a question needs it (``frontier``:
    the replay in progress, None once at the end). ``children`` maps the event index of a
    refusal to the continuation after it (the cache released, whatever the capacity)."""

    __slots__ = ("index", "start", "log", "frontier", "children", "anchor")

    def __init__(self, index: int, start: tuple, log: list, frontier):
        self.index, self.start, self.log, self.frontier = index, start, log, frontier
        self.children = {}
        self.anchor = None  # (index, state): the state at the earliest refusal of a search

    def refusal(self, events: list, cap: int):
        """The first segment this continuation creates above ``cap``, or None."""
        for entry in self.log:
            if entry[1] + entry[2] > cap:
                return entry
        while self.frontier is not None:
            allocator, live, index = self.frontier
            known = len(self.log)
            index = _advance(allocator, live, events, index, len(events), self.log, cap)
            self.frontier = None if index == len(events) else (allocator, live, index)
            for entry in self.log[known:]:
                if entry[1] + entry[2] > cap:
                    return entry
        return None


def _min_capacity(events: list, unlimited: ReplayResult, log: list, granularity: int) -> int:
    """Bisection for :func:`min_capacity_bytes` from the unlimited replay and its segment log
    ``[(event index, reserved before, segment size, releasable)]``.

    A replay with a capacity is the unlimited one until the first segment it must refuse;
    there the allocator releases every entirely free cached segment, which leaves the same
    state whatever the capacity, and either fails (not enough released) or goes on, again
    like an unlimited replay from that state, until its next refusal. So every capacity's
    fate is read off a tree of unlimited continuations, each made once (from a copy of the
    state where it starts, replayed no further than the questions asked of it need) and
    shared by all the capacities that refuse at the same events: the same answers as
    replaying each capacity, for a few partial replays."""
    peak = unlimited.reserved_peak_bytes
    lo = -(-unlimited.allocated_peak_bytes // granularity)  # ceil: anything less fails
    hi = -(-peak // granularity)  # runs
    floor = lo * granularity  # no smaller capacity is asked about
    root = _Continuation(0, (Allocator(None, track_breakdown=False), {}), log, None)
    seen = {}

    def anchor_of(node: _Continuation) -> tuple:
        """The node's state at its first segment a capacity >= floor refuses (every refusal
        asked about comes at or after it)."""
        if node.anchor is None:
            first = next(entry[0] for entry in node.log if entry[1] + entry[2] > floor)
            allocator, live = _clone(*node.start)
            _advance(allocator, live, events, node.index, first)
            node.anchor = (first, (allocator, live))
        return node.anchor

    def child(node: _Continuation, index: int) -> _Continuation:
        found = node.children.get(index)
        if found is None:
            at, state = anchor_of(node)
            allocator, live = _clone(*state)
            _advance(allocator, live, events, at, index)
            allocator.release_cached()  # the refusal: what every capacity here does
            found = node.children[index] = _Continuation(index, _clone(allocator, live), [], (allocator, live, index))
        return found

    def runs(k):
        if k not in seen:
            cap = k * granularity
            node, ok = root, True
            while True:
                refusal = node.refusal(events, cap)
                if refusal is None:
                    break  # never refused again: runs to the end
                index, reserved, size, releasable = refusal
                if reserved - releasable + size > cap:
                    ok = False  # releasing the cache is not enough: out of memory here
                    break
                node = child(node, index)
            seen[k] = ok
        return seen[k]

    while lo < hi:
        mid = (lo + hi) // 2
        if runs(mid):
            hi = mid
        else:
            lo = mid + 1
    while not runs(hi):  # confirm; walk upward should the search have been misled
        hi += 1
    return hi * granularity


def _min_capacity_by_replays(events: list, granularity: int = 2 << 20) -> int:
    """:func:`min_capacity_bytes` the direct way, one whole replay per capacity asked about (a
    reference for the tests)."""
    events = _validate(events)
    unlimited = _run(events, None, False)
    peak = unlimited.reserved_peak_bytes
    seen = {}

    def runs(k):
        if k not in seen:
            seen[k] = k * granularity >= peak or not _run(events, k * granularity, False).oom
        return seen[k]

    lo = -(-unlimited.allocated_peak_bytes // granularity)
    hi = -(-peak // granularity)
    while lo < hi:
        mid = (lo + hi) // 2
        if runs(mid):
            hi = mid
        else:
            lo = mid + 1
    while not runs(hi):
        hi += 1
    return hi * granularity


def replay(events, capacity_bytes: int | None = None) -> ReplayResult:
    """Replay a stream of ``(ALLOC, id, nbytes, category)`` / ``(FREE, id)`` events through a
    fresh :class:`Allocator` and report its peaks.

    With a ``capacity_bytes`` the replay stops at the first allocation that cannot be served
    (``oom``, ``oom_event_index``), as the training step would. Raises ``ValueError`` naming the
    event index for a malformed stream (unknown id freed, live id allocated again, negative
    size), checked over the whole stream first.
    """
    return _run(_validate(events), capacity_bytes, True)


def min_capacity_bytes(events, granularity: int = 2 << 20) -> int:
    """The smallest capacity, a multiple of ``granularity``, at which ``replay(events, capacity)``
    does not run out of memory: the memory a device must offer the step.

    It lies between the allocated peak (reserved memory is never less than allocated memory, so
    any smaller capacity fails) and the reserved peak of an unlimited replay (a capacity that
    large never refuses a segment, so its replay *is* the unlimited one and runs). It is found by
    bisection between the two, in ``granularity`` steps.

    Out-of-memory is not strictly monotone in the capacity: a smaller capacity forces cached
    segments to be released earlier, which changes the later fragmentation, for better or
    worse. So bisection finds *a* boundary -- a capacity that runs, with the step below it
    failing -- which is the smallest one whenever the failures form one interval, as they do
    in practice; a smaller capacity that also runs, below a failing one, could exist and is not
    looked for. The answer is then confirmed to run, walking upward one ``granularity`` step
    at a time until a capacity does. (The bisection only ever settles on a capacity it has
    replayed successfully or on the proven upper bound, so the confirmation is answered from
    its memo of replays and the walk is a guard that does not move; it costs no replay.)

    Speed: a capacity below the unlimited reserved peak behaves exactly like the unlimited
    replay until the first segment it has to refuse; there it releases the entirely free
    cached segments, and if that is not enough it fails. That first refusal is read from a log
    of the unlimited replay, so most failing capacities cost no replay at all; the others (and
    every capacity that runs) are replayed in full.
    """
    if granularity <= 0:
        raise ValueError(f"granularity must be positive, got {granularity}")
    events = _validate(events)
    log = []
    with _gc_paused():
        unlimited = _run(events, None, False, log)
        return _min_capacity(events, unlimited, log, granularity)


def replay_with_min_capacity(events, granularity: int = 2 << 20) -> tuple:
    """``(replay(events), min_capacity_bytes(events, granularity))``, the unlimited replay run
    once for both (the same figures, for less)."""
    if granularity <= 0:
        raise ValueError(f"granularity must be positive, got {granularity}")
    events = _validate(events)
    log = []
    with _gc_paused():
        unlimited = _run(events, None, True, log)
        return unlimited, _min_capacity(events, unlimited, log, granularity)


class _gc_paused:
    """No cyclic garbage collection while replaying (only plain Python objects are made: the
    blocks, whose cycles are broken when they are dropped); collections of a large process's
    heap would otherwise cost more than the replay."""

    def __enter__(self):
        self.enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        if self.enabled:
            gc.enable()
