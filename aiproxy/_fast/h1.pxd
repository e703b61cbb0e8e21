# Strict HTTP/1.1 head scanner and chunked decoder (RFC 9112).

cdef enum:
    F_HOP = 1          # hop-by-hop: never forwarded as-is
    F_CONTENT_LENGTH = 2
    F_TRANSFER_ENCODING = 4
    F_HOST = 8
    F_UPGRADE = 16
    F_CONNECTION = 32
    F_EXPECT = 64
    F_XFF = 128        # x-forwarded-for: merged with the client address
    F_XFP = 256        # x-forwarded-proto: replaced
    F_NAMED_BY_CONNECTION = 512
    F_OWN = 1024       # x-aiproxy-* / x_aiproxy_*: the proxy's own, never a client's


cpdef Py_ssize_t find_query(bytes target) except -2
cpdef bytes chunk_size_line(Py_ssize_t n)
cpdef bytes chunk_frame(bytes data)
# C calls from the connections (no argument boxing): defaults are in h1.pyx.
cpdef object parse_request(object buf, Py_ssize_t max_head=*, Py_ssize_t max_line=*,
                           Py_ssize_t max_headers=*, Py_ssize_t length=*)
cpdef object parse_response(object buf, Py_ssize_t max_head=*, Py_ssize_t max_headers=*,
                            Py_ssize_t length=*)


cdef class Head:
    # One allocation holds the field index (offs, then flags) and then the head's bytes
    # (raw: `size` bytes from `base`); the `raw` property copies them out for Python.
    cdef bytes _block
    cdef const char *base
    cdef readonly Py_ssize_t size
    cdef readonly Py_ssize_t consumed
    cdef readonly int version
    cdef readonly long long content_length
    cdef readonly bint chunked
    cdef readonly bint keep_alive
    cdef readonly bint keep_alive_field  # a Keep-Alive field is present (seen by the scan)
    cdef readonly bint connection_upgrade
    cdef readonly object upgrade
    cdef readonly Py_ssize_t header_count
    cdef int *offs
    cdef unsigned short *flags
    cdef Py_ssize_t start_line_end

    cdef char *_alloc(self, Py_ssize_t nh, Py_ssize_t size) except NULL
    cdef _store(self, const unsigned char *p, Py_ssize_t start, Py_ssize_t end, Py_ssize_t nh)
    cdef Py_ssize_t _find(self, bytes lname, Py_ssize_t i, bint prefix) except -2
    cdef bytes _value(self, Py_ssize_t i)
    cpdef object get(self, bytes lname)
    cpdef list get_all(self, bytes lname)
    cpdef bytes serialize(self, bytes start_line, bytes extra, unsigned int drop_mask)
    cpdef bytes compose(self, bytes start, bytes target, tuple extra, unsigned int drop_mask,
                        object tail=*)
    cpdef list fields(self, unsigned int drop_mask)


cdef class RequestHead(Head):
    cdef readonly bytes method
    cdef readonly bytes target
    cdef readonly object host
    cdef readonly bint expect_continue
    cdef readonly bint expect_unknown
    cdef readonly bint has_xff
    cdef readonly bint target_plain
    cdef readonly Py_ssize_t query_at
    cdef readonly bint body_streamed    # HTTP/2: DATA frames follow the head


cdef class ResponseHead(Head):
    cdef readonly int status
    cdef readonly bytes reason


cdef class ChunkedDecoder:
    cdef int state
    cdef readonly unsigned long long remaining  # of the chunk being read, at least
    cdef int digits
    cdef Py_ssize_t ext_len
    cdef int ext_state  # where in the chunk-ext grammar (X_* in h1.pyx)
    cdef Py_ssize_t trailer_len
    cdef Py_ssize_t max_trailer
    cdef Py_ssize_t fields, max_fields  # trailer fields seen, and allowed
    cdef bytearray _trailers
    cdef readonly bint done
    cdef readonly Py_ssize_t tail

    cdef int _trailer_byte(self, unsigned char c) except -1
    cpdef list feed_slab(self, bytearray slab, Py_ssize_t n)
    cdef int _ext_byte(self, unsigned char c) except -1
    cdef list _feed(self, object data, const unsigned char *p, Py_ssize_t n)
