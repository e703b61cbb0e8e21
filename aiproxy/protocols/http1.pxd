# Compiled by Cython in pure-Python mode (setup.py): http1.py is the source.
cimport cython

from aiproxy._fast.clock cimport event_begin, event_end, event_now, monotonic
from aiproxy._fast.bufpool cimport BufferPool, copy_out
from aiproxy._fast.h1 cimport (RequestHead, ResponseHead, chunk_frame, chunk_size_line,
                               parse_request)
from aiproxy._fast.sendnow cimport Sender
from aiproxy.pipeline.ends cimport Downstream
from aiproxy.pipeline.exchange cimport Exchange
from aiproxy.routing.table cimport Route
from aiproxy.server.runtime cimport Runtime

cdef unsigned int F_HOP, F_CONTENT_LENGTH, F_HOST, F_NAMED_BY_CONNECTION  # the module's constants, as C values
cdef bytes CRLF, LAST_CHUNK, STATUS_200
cdef int P_PIPELINE, BODY_NONE
cdef Py_ssize_t SMALL_BODY, CONTENT_LENGTH_CACHE, SMALL_LENGTHS
cdef dict CONTENT_LENGTH_LINES
cdef tuple CONTENT_LENGTH_SMALL

cpdef bytes content_length_line(long long n)
cdef BufferPool POOL  # the process's read slabs (bufpool.pyx), called in C


cdef class H1ConnectionCore(Downstream):
    cdef public object transport, timer
    cdef Sender tx  # writes to the client (sendnow.pyx)
    cdef public bytearray buf, slab
    cdef public Exchange exchange
    cdef public bytes head_out
    cdef public ResponseHead held
    cdef public bytes held_status
    cdef public tuple held_extra
    cdef public unsigned int held_drop
    cdef public long long served
    cdef public int pause_mask
    cdef public bint writing_paused, closed, lingering, tunnel, in_process, client_eof
    cdef public bint chunked_out, until_close_out, h2c, switched
    cdef public double head_started, idle_since, drain_idle  # drain_idle: see drain()

    cpdef _process(self)
    @cython.locals(head=RequestHead, ex=Exchange, rt=Runtime)
    cpdef _start_exchange(self, bytearray slab=*, Py_ssize_t nbytes=*)
    @cython.locals(rt=Runtime, e=Exchange)
    cpdef exchange_done(self, ex, bint keep_alive)
    @cython.locals(rt=Runtime, limit=cython.longlong)
    cpdef may_keep_alive(self)
    cpdef pause(self, int reason)
    cpdef resume(self, int reason)
    cpdef bint output_paused(self) except -1
    @cython.locals(head=RequestHead, rt=Runtime, e=Exchange, r=ResponseHead, route=Route,
                   status=cython.int, length=cython.longlong, chunked=cython.bint,
                   drop=cython.uint, extra=tuple)
    cpdef send_response(self, ex, resp, int mode)
    cpdef bytes _take_head(self, tail=*)
    cpdef send_body(self, data)
    cpdef flush(self)
    cpdef send_end(self, trailers)
    cpdef close(self)
    cpdef _arm(self, double delay)
    cpdef _cancel_timer(self)
    cpdef double _idle_from(self)
