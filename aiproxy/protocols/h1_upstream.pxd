# Compiled by Cython in pure-Python mode (setup.py): h1_upstream.py is the source.
# No cimport of the exchange or the pool: routing/pool.py imports this module, and a
# cimport imports its module first. The exchange is seen through its base in ends.pxd.
cimport cython

from aiproxy._fast.bufpool cimport BufferPool, copy_out
from aiproxy._fast.clock cimport event_begin, event_end
from aiproxy._fast.h1 cimport ChunkedDecoder, ResponseHead, chunk_size_line, parse_response
from aiproxy._fast.sendnow cimport Sender, closed_unsent, sent_mark, unread
from aiproxy.pipeline.ends cimport ExchangeBase, Upstream

cdef BufferPool POOL  # the process's read slabs (bufpool.pyx), called in C
cdef Py_ssize_t SMALL_COPY
cdef int _IDLE, _HEAD, _BODY, _TUNNEL, _CLOSED  # the connection's states, as C values
cdef int BODY_NONE, BODY_LENGTH, BODY_CHUNKED, BODY_UNTIL_CLOSE, BODY_TUNNEL  # ends.py's


cdef class H1UpstreamCore(Upstream):
    cdef public object pool, transport, views_to
    cdef public ChunkedDecoder decoder
    cdef Sender tx  # writes to the upstream (sendnow.pyx)
    cdef object tx_closing  # transport.is_closing, bound once
    cdef public ExchangeBase exchange
    cdef public bytearray buf, slab
    cdef public int state, mode
    cdef public long long remaining, requests
    cdef public bint no_body, keep_alive, broken, received, reading_paused, chunked, viewed
    cdef public bint unsent  # the request's first write found the connection gone
    cdef public double idle_since
    cdef public Py_ssize_t max_head, max_headers  # the pool's, read per response
    cdef public int fd
    cdef public double ka_idle

    @cython.locals(ex=ExchangeBase)
    cpdef start(self, exchange)
    cpdef send_body(self, pieces)
    cpdef end_body(self)
    cpdef usable(self)
    cpdef reusable(self, double now)
    cpdef park(self, double now)
    cpdef pause(self)
    cpdef resume(self)
    cpdef close(self)
    @cython.locals(resp=ResponseHead, ex=ExchangeBase, start=Py_ssize_t, status=cython.int,
                   mode=cython.int, max_head=Py_ssize_t)
    cpdef _head(self, bytearray slab, Py_ssize_t nbytes)
    @cython.locals(ex=ExchangeBase, mode=cython.int, n=Py_ssize_t)
    cpdef _body(self, data)
    @cython.locals(ex=ExchangeBase, decoder=ChunkedDecoder)
    cpdef _chunked(self, data, Py_ssize_t n)
    @cython.locals(ex=ExchangeBase)
    cpdef _finish(self)
