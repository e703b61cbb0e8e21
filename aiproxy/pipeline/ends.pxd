# Compiled by Cython in pure-Python mode (setup.py): ends.py is the source.

cdef class Reporter:
    cpdef exchange_done(self, ex)


cdef class ServerCore:
    cdef public object runtime  # a server.runtime.Runtime, swapped on reload
    cdef public Reporter telemetry
    cdef public bint draining, drain_expired


cdef class Downstream:
    cdef public object loop
    cdef public ServerCore server
    cdef public bytes peer, scheme
    cdef public bytes forwarded  # X-Forwarded-For/-Proto lines for this client
    cdef public object views_to  # the transport that takes views of a read slab, or None

    cpdef send_response(self, ex, resp, int mode)
    cpdef send_body(self, data)
    cpdef flush(self)
    cpdef send_end(self, trailers)
    cpdef exchange_done(self, ex, bint keep_alive)
    cpdef pause(self, int reason)
    cpdef resume(self, int reason)
    cpdef bint output_paused(self) except -1


cdef class Upstream:
    cpdef start(self, exchange)
    cpdef send_body(self, pieces)
    cpdef end_body(self)
    cpdef usable(self)
    cpdef pause(self)
    cpdef resume(self)
    cpdef close(self)


cdef class ExchangeBase:
    cdef public Downstream down
    cdef public object method
    cdef public bint up_chunked

    cpdef h1_request_head(self, pool)
    cpdef on_upstream_head(self, resp, int mode)
    cpdef on_upstream_body(self, data)
    cpdef on_upstream_end(self, trailers=*)
    cpdef flush(self)
