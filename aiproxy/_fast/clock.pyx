# The per-request clock. A request took about six loop.time() and five perf_counter()
# calls, each a Python call and a float object (about 250 and 150 instructions under
# callgrind); from C this is a vDSO call.
#
# CLOCK_MONOTONIC is the clock behind time.perf_counter() and time.monotonic() on Linux,
# so behind asyncio's loop.time(), and libuv's uv_now() (uvloop's loop.time()) reads the
# same clock (or its coarse variant), cached once per loop pass at millisecond steps. So a
# stamp from here can be a few milliseconds ahead of uvloop's loop.time(): fine for the
# idle and deadline checks that compare the two.
#
# The event stamp. A read callback took five clock reads for stamps that all mean "when
# these bytes came in" (the response head, the body activity, the pooled connection's and
# the client connection's idle-since), each a vDSO call of about 20 ns, 1.5% of a small
# request's CPU. As nginx caches the time once per event loop pass, the H1 read callbacks
# take one stamp as they begin (event_begin) and drop it as they end (event_end); between
# the two, event_now() returns it. Outside a callback that took one, event_now() reads the
# clock. Stamps that bracket work (the route decision, the request sent upstream, the
# exchange's total) keep reading the clock.

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef double _event = 0.0
cdef int _held = 0


cpdef double monotonic() noexcept nogil:
    """Seconds on CLOCK_MONOTONIC (time.monotonic(), without the Python call)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cpdef double event_begin() noexcept:
    """A read callback begins: stamp it, and return the stamp."""
    global _event, _held
    _held += 1
    if _held == 1:
        _event = monotonic()
    return _event


cpdef void event_end() noexcept:
    """The read callback that called event_begin() ends."""
    global _held
    if _held > 0:
        _held -= 1


cpdef double event_now() noexcept:
    """The stamp of the read callback under way, else the clock."""
    if _held:
        return _event
    return monotonic()
