# Compiled by Cython in pure-Python mode (setup.py): recorder.py is the source.
from aiproxy._fast.clock cimport monotonic
from aiproxy.pipeline.exchange cimport Exchange
from aiproxy.telemetry.access_log cimport iso_now, ms
from aiproxy.telemetry.metrics cimport Metrics


cdef class Telemetry:
    cdef public Metrics metrics
    cdef public object access_log

    cpdef exchange_done(self, Exchange ex)
