# Compiled by Cython in pure-Python mode (setup.py): metrics.py is the source.
from aiproxy._fast.histogram cimport Histogram
from aiproxy.pipeline.exchange cimport Exchange


cdef class Metrics:
    cdef public dict requests, stages
    cdef public Histogram h_accept, h_route, h_classify, h_connect, h_ttfb, h_total
    cdef public long long bytes_in, bytes_out, reloads, reload_failures
    cdef public object last_reload_ok, last_reload_time

    cpdef exchange_stamps(self, route, cluster, int status, long long bytes_in,
                          long long bytes_out, Exchange ex, double now)
