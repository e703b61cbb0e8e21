# Compiled by Cython in pure-Python mode (setup.py): recorder.py is the source.
cimport cython

from aiproxy._fast.clock cimport monotonic
from aiproxy.pipeline.ends cimport Reporter
from aiproxy.pipeline.exchange cimport Exchange
from aiproxy.telemetry.access_log cimport iso_now, ms
from aiproxy.telemetry.metrics cimport Metrics


cdef class Telemetry(Reporter):
    cdef public Metrics metrics
    cdef public object access_log

    @cython.locals(ex=Exchange)
    cpdef exchange_done(self, exchange)
