# Compiled by Cython in pure-Python mode (setup.py): stats.py is the source.

cdef class EndpointStats:
    cdef public long long in_flight, requests, failures, consecutive_failures, times_ejected
    cdef public long long hc_ok, hc_fail
    cdef public bint ejected, healthy
    cdef public double ejected_until, ttfb_ms, tok_start, reported_load, reported_at, score
    cdef public object eject_timer, hc_last, tok_cur, tok_prev

    cpdef observe_ttfb(self, double ms, double alpha)
