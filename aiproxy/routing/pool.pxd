# Compiled by Cython in pure-Python mode (setup.py): pool.py is the source.
cimport cython

from aiproxy._fast.clock cimport event_now, monotonic
from aiproxy.protocols.h1_upstream cimport H1UpstreamCore
from aiproxy.routing.stats cimport EndpointStats


cdef class EndpointPool:
    cdef public object loop, endpoint, host, port, _cfg  # _cfg: the cluster_cfg property's
    cdef public object host_line, authority
    cdef public long long max_head, opened, reused, open_count, max_idle, max_requests
    cdef public bint closed
    cdef public EndpointStats stats

    cpdef take(self)
    cpdef release(self, conn)


cdef class Pool(EndpointPool):
    cdef public object max_headers, _sweep
    cdef public list idle

    @cython.locals(c=H1UpstreamCore)
    cpdef take(self)
    @cython.locals(c=H1UpstreamCore)
    cpdef release(self, conn)


cdef class H2Pool(EndpointPool):
    cdef public list conns
    cdef public object connecting, capacity

    cpdef take(self)
    cpdef release(self, conn)
