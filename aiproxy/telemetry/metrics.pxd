# Compiled by Cython in pure-Python mode (setup.py): metrics.py is the source.
cimport cython

from aiproxy._fast.histogram cimport Histogram
from aiproxy.pipeline.exchange cimport Exchange


cdef int STATUS_SLOTS
cdef tuple GRPC_LABELS


cdef class StatusCounts:
    cdef long long slots[600]  # STATUS_SLOTS
    cdef public dict other

    cpdef add(self, int status)
    cpdef add_outcome(self, str outcome, int status)
    cpdef list items(self)


cdef class Metrics:
    cdef public dict requests, stages, grpc
    cdef public Histogram h_accept, h_route, h_classify, h_connect, h_ttfb, h_total
    cdef public long long bytes_in, bytes_out, reloads, reload_failures
    cdef public object last_reload_ok, last_reload_time
    cdef object last_route, last_cluster
    cdef StatusCounts last_counts

    @cython.locals(by_cluster=dict, counts=StatusCounts, code=cython.int)
    cpdef exchange_stamps(self, route, cluster, int status, long long bytes_in,
                          long long bytes_out, Exchange ex, double now)
