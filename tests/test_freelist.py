"""The Exchange's memory free list (aiproxy/_fast/freelist.pyx): memory is reused only
after nothing refers to the object, comes back as a new object would, and stays in the
GC's care."""

from __future__ import annotations

import asyncio
import gc

import uvloop
from aiproxy._fast.freelist import stats

from aiproxy.pipeline.exchange import Exchange


def fields(ex: Exchange) -> dict[str, object]:
    """Every C field of the Exchange (its public attributes) and its value."""
    out = {}
    for cls in type(ex).__mro__:
        for name, attr in vars(cls).items():
            if type(attr).__name__ in ("getset_descriptor", "member_descriptor") \
                    and not name.startswith("__"):
                out[name] = getattr(ex, name)
    return out


def fresh() -> Exchange:
    return Exchange.__new__(Exchange)


def drain_free_list() -> list[Exchange]:
    """Exchanges made until the free list is empty (kept, so it stays empty)."""
    made = []
    while stats()[0]:
        made.append(fresh())
    return made


def test_reused_memory_comes_back_as_a_new_exchange() -> None:
    held = drain_free_list()
    new = fresh()  # from the allocator: what every field starts as
    want = fields(new)
    assert len(want) > 40
    used = fresh()
    used.status = 502
    used.finished = used.head_sent = True
    used.path = b"/x"
    used.tried = ("a", "b")
    used.t_start = used.deadline_at = 12.5
    used.req_remaining = 7
    used.hold = used.intent = object()
    where = id(used)
    before = stats()[1]
    del used
    again = fresh()
    assert id(again) == where and stats()[1] == before + 1  # the same memory, reused
    assert fields(again) == want
    assert gc.is_tracked(again)
    del held


def test_an_exchange_something_still_holds_is_never_reused() -> None:
    """A timer's callback holds one after the request (as a deadline timer would): it
    keeps its fields while many others are made and dropped around it."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ex = fresh()
        ex.status = 204
        ex.path = b"/held"
        seen = []

        def later(held: Exchange) -> None:
            seen.append((held.status, held.path))

        loop.call_later(0.05, later, ex)
        where = id(ex)
        del ex
        ids = set()
        for _ in range(200):
            others = [fresh() for _ in range(8)]
            ids.update(map(id, others))
            del others
        assert where not in ids
        while not seen:
            await asyncio.sleep(0.01)
        assert seen == [(204, b"/held")]

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_exchanges_in_reference_cycles_are_collected_and_reused() -> None:
    drain_free_list()
    for _ in range(3):
        ring = [fresh() for _ in range(10)]
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
            a.hold = b  # a cycle only the GC can free
        del ring, a, b
        gc.collect()
        assert stats()[0] >= 10
        reused = [fresh() for _ in range(10)]
        assert all(gc.is_tracked(x) and x.hold is None for x in reused)
        del reused
    gc.collect()
