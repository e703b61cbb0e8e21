# The per-request clock. A request took about six loop.time() and five perf_counter()
# calls, each a Python call and a float object (about 250 and 150 instructions under
# callgrind); from C this is a vDSO call.
#
# CLOCK_MONOTONIC is the clock behind time.perf_counter() and time.monotonic() on Linux,
# so behind asyncio's loop.time(), and libuv's uv_now() (uvloop's loop.time()) reads the
# same clock (or its coarse variant), cached once per loop pass at millisecond steps. So a
# stamp from here can be a few milliseconds ahead of uvloop's loop.time(): fine for the
# idle and deadline checks that compare the two.

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cpdef double monotonic() noexcept nogil:
    """Seconds on CLOCK_MONOTONIC (time.monotonic(), without the Python call)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9
