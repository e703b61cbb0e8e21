# Compiled by Cython in pure-Python mode (setup.py): cluster.py is the source.

cdef class Cluster:
    cdef public object name, cfg, loop, balancer, checker, poller
    cdef public list pools
    cdef public long long active, pending, retries_active, overflows
    cdef public bint track_tokens, limits_connections
    cdef public double score_alpha, request_timeout
    cdef public long long max_requests

    cpdef pick(self, ex=*, exclude=*)
