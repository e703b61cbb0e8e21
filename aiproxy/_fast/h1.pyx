# cython: language_level=3
"""Strict HTTP/1.1 head scanner and chunked decoder (RFC 9112).

One pass over the head in C: the request/status line and every field line are
validated and indexed by offset; only the fields the proxy needs for framing
and hop-by-hop handling are looked at by name. Forwarding is one copy of the
kept field lines (`Head.serialize`). Anything ambiguous is rejected with the
status an origin server would send (400, 414, 431, 501, 505); the caller maps
errors in upstream responses to 502.
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject

# Borrowed tuple items and their bytes, with no reference counting: compose() walks
# its `extra` tuple twice per head.
cdef extern from "Python.h":
    PyObject *_tuple_item "PyTuple_GET_ITEM"(object t, Py_ssize_t i)
    Py_ssize_t _tuple_size "PyTuple_GET_SIZE"(object t)
    bint _is_bytes "PyBytes_Check"(PyObject *o)
    Py_ssize_t _bytes_size "PyBytes_GET_SIZE"(PyObject *o)
    char *_bytes_str "PyBytes_AS_STRING"(PyObject *o)
    PyObject *_Py_None "Py_None"
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memchr, memcmp, memcpy

cdef extern from *:
    """
    #if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    #error "h1.pyx reads bytes eight at a time and needs a little-endian machine"
    #endif
    """
    int __builtin_ctzll(unsigned long long) nogil

# Sixteen bytes a step with SSE2 (every x86-64 has it) while the bytes are plain: the
# letters, digits and '-' of a field name, the non-control bytes of a value. They stop
# at the first other byte, or where fewer than 16 bytes are left; the exact scans below
# go on from there. Elsewhere they return i and the scans do all the work.
cdef extern from *:
    """
    #if defined(__SSE2__)
    #include <emmintrin.h>
    static inline Py_ssize_t aip_name_run16(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) {
        /* Signed compares: bytes >= 0x80 are negative, so never a letter or digit. */
        const __m128i fold = _mm_set1_epi8(0x20), a = _mm_set1_epi8('a' - 1),
            z = _mm_set1_epi8('z' + 1), d0 = _mm_set1_epi8('0' - 1),
            d9 = _mm_set1_epi8('9' + 1), dash = _mm_set1_epi8('-');
        while (i + 16 <= n) {
            __m128i x = _mm_loadu_si128((const __m128i *)(p + i));
            __m128i l = _mm_or_si128(x, fold);
            __m128i good = _mm_or_si128(
                _mm_or_si128(_mm_and_si128(_mm_cmpgt_epi8(l, a), _mm_cmplt_epi8(l, z)),
                             _mm_and_si128(_mm_cmpgt_epi8(x, d0), _mm_cmplt_epi8(x, d9))),
                _mm_cmpeq_epi8(x, dash));
            unsigned int m = (unsigned int)_mm_movemask_epi8(good);
            if (m != 0xffffu)
                return i + __builtin_ctz(~m);
            i += 16;
        }
        return i;
    }
    static inline Py_ssize_t aip_value_run16(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) {
        /* A control byte: x <= 0x1f (unsigned: min(x, 0x1f) == x) or 0x7f; not HTAB. */
        const __m128i c = _mm_set1_epi8(0x1f), del = _mm_set1_epi8(0x7f),
            tab = _mm_set1_epi8(9);
        while (i + 16 <= n) {
            __m128i x = _mm_loadu_si128((const __m128i *)(p + i));
            __m128i ctl = _mm_or_si128(_mm_cmpeq_epi8(_mm_min_epu8(x, c), x),
                                       _mm_cmpeq_epi8(x, del));
            unsigned int m = (unsigned int)_mm_movemask_epi8(
                _mm_andnot_si128(_mm_cmpeq_epi8(x, tab), ctl));
            if (m)
                return i + __builtin_ctz(m);
            i += 16;
        }
        return i;
    }
    #else
    static inline Py_ssize_t aip_name_run16(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) { return i; }
    static inline Py_ssize_t aip_value_run16(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) { return i; }
    #endif
    """
    Py_ssize_t aip_name_run16(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) nogil
    Py_ssize_t aip_value_run16(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) nogil


class ParseError(Exception):
    """A message that cannot be framed safely; `status` is the reply to send."""

    def __init__(self, int status, str message):
        super().__init__(message)
        self.status = status
        self.message = message


cdef enum:
    MAX_HEADERS_CAP = 1024
    MAX_CONN_TOKENS = 32
    MAX_CL_DIGITS = 18
    MAX_CHUNK_HEX = 16
    MAX_CHUNK_EXT = 4096
    MAX_METHOD = 32

# RFC 9112 3.1: a method longer than any the server implements SHOULD get 501. The
# proxy forwards any token, so "implemented" is a length: the longest registered method
# (UPDATEREDIRECTREF) has 17 bytes.
MAX_METHOD_BYTES = MAX_METHOD

cdef unsigned char TCHAR[256]
cdef unsigned char FVCHAR[256]
cdef unsigned char TARGET[256]
cdef unsigned char REGNAME[256]
cdef signed char HEXVAL[256]

cdef int _offs[MAX_HEADERS_CAP * 5]
cdef unsigned short _flags[MAX_HEADERS_CAP]
cdef Py_ssize_t _ctok[MAX_CONN_TOKENS * 2]


cdef void _init_tables():
    cdef int c
    cdef bytes tspecial = b"!#$%&'*+-.^_`|~"
    cdef bytes regextra = b"-._~!$&'()*+,;="  # RFC 3986 unreserved and sub-delims
    for c in range(256):
        TCHAR[c] = 0
        FVCHAR[c] = 0
        TARGET[c] = 0
        REGNAME[c] = 0
        HEXVAL[c] = -1
    for c in range(ord("0"), ord("9") + 1):
        TCHAR[c] = 1
        REGNAME[c] = 1
        HEXVAL[c] = c - ord("0")
    for c in range(ord("a"), ord("z") + 1):
        TCHAR[c] = 1
        TCHAR[c - 32] = 1
        REGNAME[c] = 1
        REGNAME[c - 32] = 1
    for c in range(6):
        HEXVAL[ord("a") + c] = 10 + c
        HEXVAL[ord("A") + c] = 10 + c
    for c in tspecial:
        TCHAR[c] = 1
    for c in regextra:
        REGNAME[c] = 1
    for c in range(0x21, 0x7F):
        FVCHAR[c] = 1
        TARGET[c] = 1
    # Visible ASCII RFC 3986 has no place for (3.2-3.5, appendix A) and that browsers
    # (the WHATWG URL parser) and httpx always encode, in path and query: an invalid
    # request-line (RFC 9112 3.2: 400). '\\', '^', '`', '{', '|',
    # '}' are just as foreign to RFC 3986, but curl, httpx (the openai client) and
    # browsers' queries send them as they are: refusing them would refuse those clients.
    for c in b'"<>':
        TARGET[c] = 0
    for c in range(0x80, 0x100):
        FVCHAR[c] = 1
    FVCHAR[0x20] = 1
    FVCHAR[0x09] = 1


_init_tables()


cdef inline Py_ssize_t _fv_run(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """The first index at or after i whose byte is not FVCHAR (n if none), eight bytes
    at a time. A word with a control byte (< 0x20 or 0x7f) flags it; the lowest flag is
    always a real one (a false one needs a borrow from a real one below it), so it is
    where the run ends, unless it is HTAB, the one control byte FVCHAR allows."""
    cdef uint64_t x, y, m
    i = aip_value_run16(p, i, n)
    while i + 8 <= n:
        memcpy(&x, p + i, 8)
        y = x ^ 0x7f7f7f7f7f7f7f7fULL
        # A byte below 0x20 / a zero byte in y (Bit Twiddling Hacks).
        m = (((x - 0x2020202020202020ULL) & ~x) | ((y - 0x0101010101010101ULL) & ~y)) \
            & 0x8080808080808080ULL
        if m:
            i += __builtin_ctzll(m) >> 3
            if p[i] != 9:
                return i
            i += 1
        else:
            i += 8
    while i < n and FVCHAR[p[i]]:
        i += 1
    return i


cdef inline Py_ssize_t _tchar_run(const unsigned char *p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """The first index at or after i whose byte is not TCHAR (n if none): eight table
    lookups per step while all eight are token characters, then byte by byte."""
    i = aip_name_run16(p, i, n)
    if i < n and not TCHAR[p[i]]:
        return i  # mostly the ':' after a name of letters, digits and '-'
    while i + 8 <= n and (TCHAR[p[i]] & TCHAR[p[i + 1]] & TCHAR[p[i + 2]] & TCHAR[p[i + 3]]
                          & TCHAR[p[i + 4]] & TCHAR[p[i + 5]] & TCHAR[p[i + 6]]
                          & TCHAR[p[i + 7]]):
        i += 8
    while i < n and TCHAR[p[i]]:
        i += 1
    return i


cdef inline bint _ieq(const unsigned char *a, Py_ssize_t n, const char *lit, Py_ssize_t m) noexcept:
    # `lit` is lower case letters, digits and '-'; OR-ing 0x20 folds only A-Z onto them
    # for token and field value characters (it would also fold CR onto '-', and control
    # bytes onto digits, which neither can hold), so this is an exact case-insensitive
    # compare. Eight or four bytes a step; the last step overlaps the one before.
    cdef uint64_t x, y
    cdef uint32_t u, w
    cdef Py_ssize_t i
    if n != m:
        return 0
    if n >= 8:
        i = 0
        while i + 8 < n:
            memcpy(&x, a + i, 8)
            memcpy(&y, lit + i, 8)
            if (x | 0x2020202020202020ULL) != y:
                return 0
            i += 8
        memcpy(&x, a + n - 8, 8)
        memcpy(&y, lit + n - 8, 8)
        return (x | 0x2020202020202020ULL) == y
    if n >= 4:
        memcpy(&u, a, 4)
        memcpy(&w, lit, 4)
        if (u | 0x20202020U) != w:
            return 0
        memcpy(&u, a + n - 4, 4)
        memcpy(&w, lit + n - 4, 4)
        return (u | 0x20202020U) == w
    for i in range(n):
        if (a[i] | 0x20) != <unsigned char>lit[i]:
            return 0
    return 1


cdef bint _ieq_us(const unsigned char *name, Py_ssize_t n) noexcept:
    """Whether name, read with '_' as '-', is one of the fields above (any case)."""
    cdef unsigned char buf[17]
    cdef Py_ssize_t i
    for i in range(n):
        buf[i] = 45 if name[i] == 95 else name[i]
    if n == 14:
        return _ieq(buf, 14, b"content-length", 14)
    if n == 15:
        return _ieq(buf, 15, b"x-forwarded-for", 15)
    if n == 17:
        return (_ieq(buf, 17, b"transfer-encoding", 17)
                or _ieq(buf, 17, b"x-forwarded-proto", 17))
    return 0


cdef inline bint _ieq2(const unsigned char *a, const unsigned char *b, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    cdef unsigned char x, y
    for i in range(n):
        x = a[i]
        y = b[i]
        if 65 <= x <= 90:
            x += 32
        if 65 <= y <= 90:
            y += 32
        if x != y:
            return 0
    return 1


cdef long long _parse_content_length(const unsigned char *p, Py_ssize_t a, Py_ssize_t b):
    """1*DIGIT, or a list of identical values (RFC 9110 8.6). -1 on any error."""
    cdef long long value = -1, cur
    cdef Py_ssize_t i = a, start, digits
    while True:
        while i < b and (p[i] == 32 or p[i] == 9):
            i += 1
        cur = 0
        start = i
        digits = 0  # significant ones: any number of leading zeros is still 1*DIGIT
        while i < b and 48 <= p[i] <= 57:
            cur = cur * 10 + (p[i] - 48)
            if cur:
                digits += 1
                if digits > MAX_CL_DIGITS:
                    return -1
            i += 1
        if i == start:
            return -1
        if value != -1 and cur != value:
            return -1
        value = cur
        while i < b and (p[i] == 32 or p[i] == 9):
            i += 1
        if i == b:
            return value
        if p[i] != 44:  # ','
            return -1
        i += 1


# Heads hold only bytes (and None): they can be in no reference cycle, so they stay
# out of the garbage collector's lists (no tracking on every allocation and free).
@cython.no_gc
cdef class Head:
    def __cinit__(self):
        self.offs = NULL
        self.flags = NULL
        self.content_length = -1
        self.upgrade = None

    cdef char *_alloc(self, Py_ssize_t nh, Py_ssize_t size) except NULL:
        # One bytes object, freed with the head (no __dealloc__): the offsets, the
        # flags (ints first keeps them aligned), then room for the head's bytes.
        cdef Py_ssize_t index = nh * (5 * sizeof(int) + sizeof(unsigned short))
        self._block = PyBytes_FromStringAndSize(NULL, index + size)
        self.offs = <int *>PyBytes_AS_STRING(self._block)
        self.flags = <unsigned short *>(self.offs + nh * 5)
        self.base = PyBytes_AS_STRING(self._block) + index
        self.size = size
        self.header_count = nh
        return <char *>self.base

    cdef _store(self, const unsigned char *p, Py_ssize_t start, Py_ssize_t end, Py_ssize_t nh):
        memcpy(self._alloc(nh, end - start), p + start, end - start)
        memcpy(self.offs, _offs, nh * 5 * sizeof(int))
        memcpy(self.flags, _flags, nh * sizeof(unsigned short))

    @property
    def raw(self):
        """The head as received (HTTP/2: as field lines), a copy."""
        return PyBytes_FromStringAndSize(self.base, self.size)

    cdef Py_ssize_t _find(self, bytes lname, Py_ssize_t i, bint prefix) except -2:
        """The index of the first field from i on named `lname` (lower case), or whose
        name starts with it (prefix); -1 if none."""
        if lname is None:
            raise TypeError("a field name is bytes, not None")
        cdef const unsigned char *r = <const unsigned char *>self.base
        cdef const unsigned char *q = <const unsigned char *>PyBytes_AS_STRING(lname)
        cdef Py_ssize_t m = PyBytes_GET_SIZE(lname), n
        cdef int *o
        while i < self.header_count:
            o = self.offs + 5 * i
            n = o[1] - o[0]
            if (n == m or (prefix and n > m)) and _ieq2(r + o[0], q, m):
                return i
            i += 1
        return -1

    cdef bytes _value(self, Py_ssize_t i):
        cdef int *o = self.offs + 5 * i
        return PyBytes_FromStringAndSize(self.base + o[2], o[3] - o[2])

    cpdef object get(self, bytes lname):
        """First value of the field `lname` (lower case), or None."""
        cdef Py_ssize_t i = self._find(lname, 0, False)
        return None if i < 0 else self._value(i)

    cpdef list get_all(self, bytes lname):
        cdef list out = []
        cdef Py_ssize_t i = self._find(lname, 0, False)
        while i >= 0:
            out.append(self._value(i))
            i = self._find(lname, i + 1, False)
        return out

    def headers(self):
        """All fields as (name, value) in arrival order, names as sent."""
        cdef const char *r = self.base
        cdef Py_ssize_t i
        cdef int *o
        out = []
        for i in range(self.header_count):
            o = self.offs + 5 * i
            out.append((PyBytes_FromStringAndSize(r + o[0], o[1] - o[0]),
                        PyBytes_FromStringAndSize(r + o[2], o[3] - o[2])))
        return out

    cpdef list fields(self, unsigned int drop_mask):
        """(lower-cased name, value) for every field whose flags miss drop_mask."""
        cdef const char *r = self.base
        cdef Py_ssize_t i, j, n
        cdef int *o
        cdef bytes name
        cdef char *w
        cdef list out = []
        for i in range(self.header_count):
            if self.flags[i] & drop_mask:
                continue
            o = self.offs + 5 * i
            n = o[1] - o[0]
            name = PyBytes_FromStringAndSize(r + o[0], n)
            w = PyBytes_AS_STRING(name)
            for j in range(n):
                if 65 <= w[j] <= 90:
                    w[j] += 32
            out.append((name, PyBytes_FromStringAndSize(r + o[2], o[3] - o[2])))
        return out

    def header_flags(self):
        return [self.flags[i] for i in range(self.header_count)]

    cpdef bytes serialize(self, bytes start_line, bytes extra, unsigned int drop_mask):
        """start_line + every field line whose flags miss drop_mask + extra + CRLF."""
        cdef bytes out = PyBytes_FromStringAndSize(
            NULL, len(start_line) + _kept_size(self, drop_mask) + len(extra) + 2)
        cdef char *dst = _put(PyBytes_AS_STRING(out), start_line)
        dst = _put(_copy_kept(self, dst, drop_mask), extra)
        dst[0] = 13
        dst[1] = 10
        return out

    cpdef bytes compose(self, bytes start, bytes target, tuple extra, unsigned int drop_mask,
                        object tail=None):
        """serialize(start_line, b"".join(extra), drop_mask) + tail in one allocation.
        The start line is `start` as it is (a status line) when target is None, else
        the request line `start SP target SP HTTP/1.1 CRLF` (start is the method). The
        added field lines come as pieces, bytes or None (skipped): a tuple with a slot
        per kind of line costs no list growth. tail (any buffer, or None) is body bytes
        to send behind the head."""
        if start is None:
            raise TypeError("compose() needs a start line")
        if extra is None:
            raise TypeError("compose() needs a tuple of added lines")
        cdef Py_ssize_t total = _kept_size(self, drop_mask) + 2 + len(start)
        if target is not None:
            total += 1 + len(target) + 11  # SP target, then " HTTP/1.1" CRLF
        cdef Py_ssize_t i, nextra = _tuple_size(extra)
        cdef PyObject *piece
        for i in range(nextra):
            piece = _tuple_item(extra, i)
            if piece != _Py_None:
                if not _is_bytes(piece):
                    raise TypeError(f"Expected bytes, got {type(<object>piece).__name__}")
                total += _bytes_size(piece)
        cdef char *dst
        cdef Py_buffer view
        view.len = 0
        cdef bint held = tail is not None and type(tail) is not bytes
        if held:
            PyObject_GetBuffer(tail, &view, PyBUF_SIMPLE)
        elif tail is not None:
            view.buf = PyBytes_AS_STRING(tail)  # no buffer to take and release
            view.len = PyBytes_GET_SIZE(tail)
        cdef bytes out
        try:
            out = PyBytes_FromStringAndSize(NULL, total + view.len)
            dst = _put(PyBytes_AS_STRING(out), start)
            if target is not None:
                dst[0] = 32
                dst = _put(dst + 1, target)
                memcpy(dst, b" HTTP/1.1\r\n", 11)
                dst += 11
            dst = _copy_kept(self, dst, drop_mask)
            for i in range(nextra):
                piece = _tuple_item(extra, i)
                if piece != _Py_None:
                    memcpy(dst, _bytes_str(piece), _bytes_size(piece))
                    dst += _bytes_size(piece)
            dst[0] = 13
            dst[1] = 10
            if view.len:
                memcpy(dst + 2, view.buf, view.len)
        finally:
            if held:
                PyBuffer_Release(&view)
        return out


cdef inline Py_ssize_t _kept_size(Head h, unsigned int drop_mask):
    """Bytes of the field lines (CRLF included) whose flags miss drop_mask."""
    cdef Py_ssize_t total = 0, i
    cdef int *o
    for i in range(h.header_count):
        if not (h.flags[i] & drop_mask):
            o = h.offs + 5 * i
            total += o[4] - o[0]
    return total


cdef inline char *_copy_kept(Head h, char *dst, unsigned int drop_mask):
    """Copy those field lines to dst, as they arrived; returns the end. Lines lie back
    to back in the head, so each run of kept ones is one copy."""
    cdef const char *r = h.base
    cdef Py_ssize_t i, a = 0, b = 0
    cdef int *o
    for i in range(h.header_count):
        if h.flags[i] & drop_mask:
            continue
        o = h.offs + 5 * i
        if o[0] != b:
            if b > a:
                memcpy(dst, r + a, b - a)
                dst += b - a
            a = o[0]
        b = o[4]
    memcpy(dst, r + a, b - a)
    return dst + (b - a)


cdef inline char *_put(char *dst, bytes piece):
    cdef Py_ssize_t ln = len(piece)
    memcpy(dst, PyBytes_AS_STRING(piece), ln)
    return dst + ln

@cython.no_gc
cdef class RequestHead(Head):
    def __repr__(self):
        version = "2" if self.version == 20 else f"1.{self.version % 10}"
        return f"<RequestHead {self.method!r} {self.target!r} HTTP/{version}>"


cdef const char *_HEXDIGITS = b"0123456789abcdef"


cdef inline Py_ssize_t _hex_digits(size_t v) noexcept:
    cdef Py_ssize_t d = 1
    while v >= 16:
        v >>= 4
        d += 1
    return d


cdef inline char *_put_size_line(char *p, size_t v, Py_ssize_t digits) noexcept:
    cdef Py_ssize_t i
    for i in range(digits - 1, -1, -1):
        p[i] = _HEXDIGITS[v & 15]
        v >>= 4
    p[digits] = 13
    p[digits + 1] = 10
    return p + digits + 2


cpdef bytes chunk_size_line(Py_ssize_t n):
    """b"%x\r\n" % n (an HTTP/1.1 chunk's size line) without the format machinery."""
    if n < 0:
        raise ValueError("negative chunk size")
    cdef Py_ssize_t digits = _hex_digits(<size_t>n)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, digits + 2)
    _put_size_line(PyBytes_AS_STRING(out), <size_t>n, digits)
    return out


cpdef bytes chunk_frame(bytes data):
    """`data` as one whole HTTP/1.1 chunk (size line, data, CRLF) in one bytes object:
    a streamed event goes out with one write and one buffer instead of three."""
    if data is None:
        raise TypeError("chunk_frame() needs bytes, not None")
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t digits = _hex_digits(<size_t>n)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, digits + n + 4)
    cdef char *p = _put_size_line(PyBytes_AS_STRING(out), <size_t>n, digits)
    memcpy(p, PyBytes_AS_STRING(data), n)
    p[n] = 13
    p[n + 1] = 10
    return out


cpdef Py_ssize_t find_query(bytes target) except -2:
    """Where the '?' of a request target is, or -1: target.find(b"?") as a C call."""
    if target is None:
        raise TypeError("find_query() needs bytes, not None")
    cdef const char *p = PyBytes_AS_STRING(target)
    cdef const char *hit = <const char *>memchr(p, 63, len(target))  # '?'
    return -1 if hit == NULL else hit - p


cdef bint _all_in(bytes s, const unsigned char *table) noexcept:
    cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(s)
    cdef Py_ssize_t i
    for i in range(PyBytes_GET_SIZE(s)):
        if not table[p[i]]:
            return 0
    return 1


cpdef bint valid_field_line(bytes name, bytes value):
    """Whether name is a token and value field-content an HTTP/1.1 head may carry
    (RFC 9110 5.1, 5.5): for fields that arrived over HTTP/2."""
    return (PyBytes_GET_SIZE(name) > 0 and _all_in(name, TCHAR)
            and _all_in(value, FVCHAR))


def fields_request_head(list items, list flags, long long content_length, bytes method,
                        bytes target, object host, bint has_xff, bint body_streamed):
    """A RequestHead (version 20) for a request that arrived as a field list: HTTP/2,
    or the HTTP/1.1 request of an h2c upgrade, already checked (protocols/fields.py).
    The fields are laid out as HTTP/1.1 field lines, so the head's methods work on it
    as on a parsed one and the exchange handles both kinds of request in C."""
    cdef Py_ssize_t nh = len(items), i, size = 0
    cdef bytes name, value
    cdef int *o
    cdef char *dst
    if len(flags) != nh:
        raise ValueError("one flag per field")
    # What HTTP/1.1 allows, since the head is written as HTTP/1.1 (upstream, and the
    # request line): HTTP/2 itself only rules out NUL, CR and LF (RFC 9113 8.2.1).
    if not _all_in(method, TCHAR) or not method:
        raise ValueError("invalid :method")
    if not _all_in(target, TARGET):
        raise ValueError("invalid :path")
    for i in range(nh):
        name, value = items[i]
        if not name or not _all_in(name, TCHAR):
            raise ValueError("invalid field name")
        if not _all_in(value, FVCHAR):
            raise ValueError("invalid field value")
        size += len(name) + len(value) + 4
    cdef RequestHead h = RequestHead.__new__(RequestHead)
    dst = h._alloc(nh, size)
    for i in range(nh):
        name, value = items[i]
        o = h.offs + 5 * i
        o[0] = <int>(dst - h.base)
        dst = _put(dst, name)
        o[1] = <int>(dst - h.base)
        dst[0] = 58  # ':'
        dst[1] = 32
        o[2] = o[1] + 2
        dst = _put(dst + 2, value)
        o[3] = <int>(dst - h.base)
        dst[0] = 13
        dst[1] = 10
        dst += 2
        o[4] = o[3] + 2
        h.flags[i] = <unsigned short>flags[i]
    h.version = 20
    h.content_length = content_length
    h.keep_alive = True
    h.method = method
    h.target = target
    h.host = host
    h.has_xff = has_xff
    h.query_at = -1
    h.body_streamed = body_streamed
    return h


@cython.no_gc
cdef class ResponseHead(Head):
    def __repr__(self):
        return f"<ResponseHead {self.status} HTTP/1.{self.version % 10}>"


cdef struct FieldState:
    Py_ssize_t nh
    int cl_count
    long long content_length
    bint te_present
    bint te_last_chunked
    int te_chunked_count
    bint te_other
    bint te_empty
    bint conn_close
    bint conn_keepalive
    bint conn_upgrade
    bint keep_alive_field
    int ntok
    int host_count
    Py_ssize_t host_idx
    Py_ssize_t upgrade_idx
    int upgrade_count
    bint expect_continue
    bint expect_unknown
    bint has_xff


cdef inline int _conn_token(FieldState *st, Py_ssize_t ts, Py_ssize_t te) except -1:
    """Record a Connection option's span (the fields it names are hop-by-hop)."""
    if st.ntok >= MAX_CONN_TOKENS:
        raise ParseError(400, "too many Connection options")
    _ctok[2 * st.ntok] = ts
    _ctok[2 * st.ntok + 1] = te
    st.ntok += 1
    return 0


cdef int _scan_list_tokens(const unsigned char *p, Py_ssize_t a, Py_ssize_t b,
                           FieldState *st, int which) except -1:
    """Split a field value on commas. which: 0 = Connection, 1 = Transfer-Encoding,
    2 = Expect."""
    cdef Py_ssize_t i = a, ts, te
    if which == 0 and b - a == 10 and _ieq(p + a, 10, b"keep-alive", 10):
        # The common whole value (vs..ve carry no outer whitespace): what the loop
        # below records for it, without its byte-at-a-time comma scan.
        st.conn_keepalive = 1
        return _conn_token(st, a, b)
    while i <= b:
        while i < b and (p[i] == 32 or p[i] == 9):
            i += 1
        ts = i
        while i < b and p[i] != 44:
            i += 1
        te = i
        while te > ts and (p[te - 1] == 32 or p[te - 1] == 9):
            te -= 1
        i += 1
        if te == ts:
            continue  # empty list elements are allowed and ignored
        if which == 0:
            if _ieq(p + ts, te - ts, b"close", 5):
                st.conn_close = 1
            elif _ieq(p + ts, te - ts, b"keep-alive", 10):
                st.conn_keepalive = 1
            elif _ieq(p + ts, te - ts, b"upgrade", 7):
                st.conn_upgrade = 1
            _conn_token(st, ts, te)
        elif which == 2:
            if _ieq(p + ts, te - ts, b"100-continue", 12):
                st.expect_continue = 1
            else:
                st.expect_unknown = 1  # any element with another expectation counts
        else:
            st.te_present = 1
            if _ieq(p + ts, te - ts, b"chunked", 7):
                st.te_chunked_count += 1
                st.te_last_chunked = 1
            else:
                st.te_other = 1
                st.te_last_chunked = 0
    return 0


cdef Py_ssize_t _scan_fields(const unsigned char *p, Py_ssize_t pos, Py_ssize_t n,
                             Py_ssize_t start, Py_ssize_t max_head, Py_ssize_t max_headers,
                             FieldState *st) except -2:
    """Scan field lines from pos. Returns the end of the head (after the empty
    line) or -1 when more bytes are needed. Offsets are stored relative to start."""
    cdef Py_ssize_t k, v, vs, ve, nlen, i, j
    cdef unsigned short fl
    cdef int *o
    cdef const unsigned char *name
    cdef long long cl
    while True:
        if pos - start > max_head:
            raise ParseError(431, "request header section too large")
        if pos >= n:
            return -1
        if p[pos] == 13:
            if pos + 1 >= n:
                return -1
            if p[pos + 1] != 10:
                raise ParseError(400, "bare CR in header section")
            pos += 2
            break
        if p[pos] == 10:
            raise ParseError(400, "bare LF in header section")
        if p[pos] == 32 or p[pos] == 9:
            raise ParseError(400, "obsolete line folding or leading whitespace in header section")
        k = _tchar_run(p, pos, n)
        if k >= n:
            if k - start > max_head:
                raise ParseError(431, "request header section too large")
            return -1
        if p[k] != 58:  # ':'
            raise ParseError(400, "invalid header field name")
        if k == pos:
            raise ParseError(400, "empty header field name")
        v = k + 1
        while v < n and (p[v] == 32 or p[v] == 9):
            v += 1
        vs = v
        v = _fv_run(p, v, n)
        if v >= n or (p[v] == 13 and v + 1 >= n):
            if v - start > max_head:
                raise ParseError(431, "request header section too large")
            return -1
        if p[v] != 13:
            if p[v] == 10:
                raise ParseError(400, "bare LF in header field")
            raise ParseError(400, "invalid character in header field value")
        if p[v + 1] != 10:
            raise ParseError(400, "bare CR in header field")
        ve = v
        while ve > vs and (p[ve - 1] == 32 or p[ve - 1] == 9):
            ve -= 1
        if st.nh >= max_headers or st.nh >= MAX_HEADERS_CAP:
            raise ParseError(431, "too many header fields")
        name = p + pos
        nlen = k - pos
        fl = 0
        # By length first (a jump table), then one compare per candidate name.
        if nlen == 4:
            if _ieq(name, 4, b"host", 4):
                fl = F_HOST
                st.host_count += 1
                st.host_idx = st.nh
        elif nlen == 14:
            if _ieq(name, 14, b"content-length", 14):
                fl = F_CONTENT_LENGTH
                st.cl_count += 1
                cl = _parse_content_length(p, vs, ve)
                if cl < 0:
                    raise ParseError(400, "invalid Content-Length")
                if st.content_length != -1 and st.content_length != cl:
                    raise ParseError(400, "conflicting Content-Length values")
                st.content_length = cl
            elif _ieq(name, 14, b"http2-settings", 14):
                fl = F_HOP  # RFC 7540 3.2.1: for the immediate connection only
        elif nlen == 17:
            if _ieq(name, 17, b"transfer-encoding", 17):
                fl = F_TRANSFER_ENCODING | F_HOP
                st.te_present = 1
                _scan_list_tokens(p, vs, ve, st, 1)
            elif _ieq(name, 17, b"x-forwarded-proto", 17):
                fl = F_XFP
        elif nlen == 10:
            if _ieq(name, 10, b"connection", 10):
                fl = F_CONNECTION | F_HOP
                _scan_list_tokens(p, vs, ve, st, 0)
            elif _ieq(name, 10, b"keep-alive", 10):
                fl = F_HOP
                st.keep_alive_field = 1
        elif nlen == 2:
            if _ieq(name, 2, b"te", 2):
                fl = F_HOP
        elif nlen == 7:
            if _ieq(name, 7, b"trailer", 7):
                fl = F_HOP
            elif _ieq(name, 7, b"upgrade", 7):
                fl = F_UPGRADE | F_HOP
                st.upgrade_idx = st.nh
                st.upgrade_count += 1
        elif nlen == 6:
            if _ieq(name, 6, b"expect", 6):
                fl = F_EXPECT | F_HOP
                # A list (RFC 9110 10.1.1): empty elements ignored, as for Connection.
                _scan_list_tokens(p, vs, ve, st, 2)
        elif nlen == 15:
            if _ieq(name, 15, b"x-forwarded-for", 15):
                fl = F_XFF
                st.has_xff = 1
        elif nlen == 5:
            if _ieq(name, 5, b"proxy", 5):
                fl = F_HOP  # httpoxy
        if fl == 0 and nlen > 6 and _ieq(name, 6, b"proxy-", 6):
            fl = F_HOP
        elif (fl == 0 and nlen >= 10 and (name[0] | 0x20) == 120  # x-aiproxy-, x_aiproxy_
              and (name[1] == 45 or name[1] == 95) and name[9] == name[1]
              and _ieq(name + 2, 7, b"aiproxy", 7)):
            fl = F_OWN
        if fl == 0 and 14 <= nlen <= 17 and memchr(name, 95, nlen) != NULL:
            # Content_Length, Transfer_Encoding, X_Forwarded_For/Proto: valid tokens,
            # but servers that map '-' and '_' alike (CGI/WSGI environ names) read them
            # as the fields: framing the proxy did not apply, or forwarding it did not
            # set. Not forwarded, as nginx (underscores_in_headers off) drops them.
            if _ieq_us(name, nlen):
                fl = F_HOP
        o = _offs + 5 * st.nh
        o[0] = <int>(pos - start)
        o[1] = <int>(k - start)
        o[2] = <int>(vs - start)
        o[3] = <int>(ve - start)
        o[4] = <int>(v + 2 - start)
        _flags[st.nh] = fl
        st.nh += 1
        pos = v + 2
    if pos - start > max_head:
        raise ParseError(431, "request header section too large")
    # Fields named by Connection are hop-by-hop too, except the ones framing and
    # routing depend on (a classic smuggling trick is `Connection: content-length`).
    for j in range(st.ntok):
        for i in range(st.nh):
            o = _offs + 5 * i
            if (o[1] - o[0] == _ctok[2 * j + 1] - _ctok[2 * j]
                    and not (_flags[i] & (F_HOST | F_CONTENT_LENGTH))
                    and _ieq2(p + start + o[0], p + _ctok[2 * j], o[1] - o[0])):
                _flags[i] |= F_HOP | F_NAMED_BY_CONNECTION
                if _flags[i] & F_XFF:
                    # Hop-by-hop now (RFC 9110 7.6.1): the proxy's X-Forwarded-For
                    # starts afresh from the client's address.
                    st.has_xff = 0
    return pos


cdef inline void _init_state(FieldState *st) noexcept:
    st.nh = 0
    st.cl_count = 0
    st.content_length = -1
    st.te_present = 0
    st.te_last_chunked = 0
    st.te_chunked_count = 0
    st.te_other = 0
    st.te_empty = 0
    st.conn_close = 0
    st.conn_keepalive = 0
    st.conn_upgrade = 0
    st.keep_alive_field = 0
    st.ntok = 0
    st.host_count = 0
    st.host_idx = -1
    st.upgrade_idx = -1
    st.upgrade_count = 0
    st.expect_continue = 0
    st.expect_unknown = 0
    st.has_xff = 0


cdef int _check_prefix(const unsigned char *p, Py_ssize_t a, Py_ssize_t n, const char *lit, Py_ssize_t m) except -2:
    """1 if p[a:a+m] == lit, 0 if the bytes present so far match but are too few, raise otherwise."""
    cdef Py_ssize_t i
    for i in range(m):
        if a + i >= n:
            return 0
        if p[a + i] != <unsigned char>lit[i]:
            return -1
    return 1


cdef int _parse_version(const unsigned char *p, Py_ssize_t a, Py_ssize_t n, int *version) except -2:
    """HTTP/D.D at p[a:]. 1 ok, 0 incomplete, -1 invalid; version as 10*major+minor."""
    cdef int r = _check_prefix(p, a, n, b"HTTP/", 5)
    if r != 1:
        return r
    if a + 5 >= n:
        return 0
    if not (48 <= p[a + 5] <= 57):
        return -1
    if a + 6 >= n:
        return 0
    if p[a + 6] != 46:
        return -1
    if a + 7 >= n:
        return 0
    if not (48 <= p[a + 7] <= 57):
        return -1
    version[0] = (p[a + 5] - 48) * 10 + (p[a + 7] - 48)
    return 1


# Shared objects for the values most heads carry: no allocation for them per message.
cdef tuple METHODS = (b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH")
cdef tuple REASONS = (b"OK", b"No Content", b"Not Modified", b"Not Found")


cdef inline bytes _known_bytes(const unsigned char *p, Py_ssize_t n, tuple known):
    cdef bytes b
    for b in known:
        if PyBytes_GET_SIZE(b) == n and memcmp(PyBytes_AS_STRING(b), p, n) == 0:
            return b
    return PyBytes_FromStringAndSize(<const char *>p, n)


cpdef object parse_request(object buf, Py_ssize_t max_head=32768,
                          Py_ssize_t max_line=8192, Py_ssize_t max_headers=100,
                          Py_ssize_t length=-1):
    """Parse a request head at the start of buf (its first `length` bytes when given:
    a read buffer filled in part). None when incomplete."""
    # A plain buffer request: a typed memoryview costs more than the parse of a
    # small head (bench/bench_h1.py).
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    cdef Py_ssize_t n = view.len
    if 0 <= length < n:
        n = length
    try:
        return _parse_request(<const unsigned char *>view.buf, n, max_head, max_line,
                              max_headers)
    finally:
        PyBuffer_Release(&view)


cdef object _parse_request(const unsigned char *p, Py_ssize_t n, Py_ssize_t max_head,
                           Py_ssize_t max_line, Py_ssize_t max_headers):
    if n == 0:
        return None
    cdef Py_ssize_t start = 0, i, j, k, line_end, end
    cdef int version = 0, r
    cdef int *o
    cdef FieldState st
    # RFC 9112 2.2: ignore empty lines received before the request-line.
    while start + 1 < n and p[start] == 13 and p[start + 1] == 10:
        start += 2
        if start > max_head:
            raise ParseError(400, "too many empty lines before request")
    if start >= n or (p[start] == 13 and start + 1 >= n):
        return None
    i = start
    while i < n and TCHAR[p[i]]:
        i += 1
    if i - start > MAX_METHOD:
        raise ParseError(501, "request method too long")
    if i >= n:
        if i - start > max_line:
            raise ParseError(414, "request line too long")
        return None
    if i == start or p[i] != 32:
        raise ParseError(400, "invalid request method")
    j = i + 1
    while j < n and TARGET[p[j]]:
        j += 1
    if j - start > max_line:
        raise ParseError(414, "request line too long")
    if j >= n:
        return None
    if j == i + 1 or p[j] != 32:
        raise ParseError(400, "invalid request target")
    r = _parse_version(p, j + 1, n, &version)
    if r == -1:
        raise ParseError(400, "invalid HTTP version")
    if r == 0:
        return None
    line_end = j + 9
    if line_end >= n or (p[line_end] == 13 and line_end + 1 >= n):
        return None
    if p[line_end] != 13 or p[line_end + 1] != 10:
        raise ParseError(400, "invalid request line ending")
    if version // 10 != 1:
        raise ParseError(505, "HTTP version not supported")
    if version > 11:
        version = 11
    _init_state(&st)
    end = _scan_fields(p, line_end + 2, n, start, max_head, max_headers, &st)
    if end < 0:
        return None

    cdef RequestHead h = RequestHead.__new__(RequestHead)
    h._store(p, start, end, st.nh)
    h.consumed = end
    h.start_line_end = line_end + 2 - start
    h.version = version
    h.method = _known_bytes(p + start, i - start, METHODS)
    h.target = PyBytes_FromStringAndSize(<const char *>p + i + 1, j - i - 1)
    _scan_target(h, p + i + 1, j - i - 1)
    _finish_framing(h, &st, 1)
    if st.host_count > 1:
        raise ParseError(400, "multiple Host fields")
    if st.host_count == 0:
        if version == 11:
            raise ParseError(400, "missing Host field")
        h.host = None
    else:
        o = h.offs + 5 * st.host_idx
        # RFC 9112 3.2: an invalid value is a 400; an empty one is what a client sends
        # for a target without an authority, and valid.
        if o[3] > o[2] and not _authority_ok(p + start + o[2], o[3] - o[2]):
            raise ParseError(400, "invalid Host field")
        h.host = PyBytes_FromStringAndSize(<const char *>p + start + o[2], o[3] - o[2])
    # RFC 9110 10.1.1: a 100-continue expectation in HTTP/1.0 MUST be ignored.
    h.expect_continue = st.expect_continue and version >= 11
    h.expect_unknown = st.expect_unknown
    h.has_xff = st.has_xff
    return h


cdef bint _authority_ok(const unsigned char *p, Py_ssize_t n) noexcept:
    """RFC 3986 3.2 authority without userinfo (RFC 9110 4.2.1, RFC 9113 8.3.1):
    host [":" port]. host is an IP-literal in brackets (IPv6: hex digits, ':' and '.';
    or IPvFuture), or a reg-name (which covers IPv4) of unreserved, sub-delims and
    %XX; port is digits. Not empty."""
    cdef Py_ssize_t i = 0, j
    if n == 0:
        return 0
    if p[0] == 91:  # '['
        i = 1
        if i < n and (p[i] == 118 or p[i] == 86):  # IPvFuture: "v" 1*HEXDIG "." 1*(...)
            i += 1
            j = i
            while i < n and HEXVAL[p[i]] >= 0:
                i += 1
            if i == j or i >= n or p[i] != 46:
                return 0
            i += 1
            j = i
            while i < n and (REGNAME[p[i]] or p[i] == 58):
                i += 1
            if i == j:
                return 0
        else:
            j = 0  # colons seen: an IPv6 address has at least two
            while i < n and (HEXVAL[p[i]] >= 0 or p[i] == 58 or p[i] == 46):
                j += p[i] == 58
                i += 1
            if j < 2:
                return 0
        if i >= n or p[i] != 93:  # ']'
            return 0
        i += 1
    else:
        while i < n and p[i] != 58:
            if p[i] == 37:  # '%' HEXDIG HEXDIG
                if i + 2 >= n or HEXVAL[p[i + 1]] < 0 or HEXVAL[p[i + 2]] < 0:
                    return 0
                i += 3
            elif REGNAME[p[i]]:
                i += 1
            else:
                return 0
        if i == 0:
            return 0
    if i == n:
        return 1
    if p[i] != 58:
        return 0
    for j in range(i + 1, n):
        if not 48 <= p[j] <= 57:
            return 0
    return 1


cpdef bint valid_authority(bytes value):
    """Whether value is host [":" port] (see _authority_ok): a Host field, an :authority,
    or the authority of an absolute-form target."""
    return _authority_ok(<const unsigned char *>PyBytes_AS_STRING(value), len(value))


cdef void _scan_target(RequestHead h, const unsigned char *t, Py_ssize_t n) noexcept:
    # query_at: offset of the first '?' (-1: none). target_plain: origin-form with no '#'
    # and a path (the part before '?') that needs no normalizing (no '%', '\\', "/." or
    # "//"), so the exchange can take it as is (aiproxy/pipeline/paths.py
    # needs_normalizing).
    cdef Py_ssize_t k, q = -1
    cdef bint plain = n > 0 and t[0] == 47
    for k in range(n):
        if t[k] == 35:  # '#'
            plain = 0
        elif q < 0:
            if t[k] == 63:  # '?'
                q = k
            elif t[k] == 37 or t[k] == 92 or (  # '%', '\\', "/.", "//"
                    t[k] == 47 and k + 1 < n and (t[k + 1] == 46 or t[k + 1] == 47)):
                plain = 0
    h.query_at = q
    h.target_plain = plain


cdef _finish_framing(Head h, FieldState *st, bint is_request):
    if st.te_present:
        if h.version == 10:
            raise ParseError(400, "Transfer-Encoding in an HTTP/1.0 message")
        if st.cl_count:
            raise ParseError(400, "both Content-Length and Transfer-Encoding")
        if st.te_chunked_count == 0 and not st.te_other:
            raise ParseError(400, "empty Transfer-Encoding")
        if st.te_chunked_count > 1:
            raise ParseError(400, "chunked applied more than once")
        if not st.te_last_chunked:
            raise ParseError(400, "the final transfer coding is not chunked")
        if st.te_other:
            raise ParseError(501, "unsupported transfer coding")
        h.chunked = 1
    h.content_length = st.content_length
    h.connection_upgrade = st.conn_upgrade
    h.keep_alive_field = st.keep_alive_field
    if h.version >= 11:
        h.keep_alive = not st.conn_close
    else:
        h.keep_alive = st.conn_keepalive and not st.conn_close
    cdef int *o
    if st.upgrade_idx >= 0 and st.conn_upgrade and h.version >= 11:
        if st.upgrade_count > 1:
            # Several field lines are one list (RFC 9110 5.3): every protocol offered.
            h.upgrade = b", ".join([v for v in h.get_all(b"upgrade") if v]) or b""
        else:
            o = h.offs + 5 * st.upgrade_idx
            h.upgrade = PyBytes_FromStringAndSize(h.base + o[2], o[3] - o[2])


cpdef object parse_response(object buf, Py_ssize_t max_head=32768,
                           Py_ssize_t max_headers=100, Py_ssize_t length=-1):
    """Parse a response head at the start of buf (its first `length` bytes when given).
    None when incomplete."""
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    cdef Py_ssize_t n = view.len
    if 0 <= length < n:
        n = length
    try:
        return _parse_response(<const unsigned char *>view.buf, n, max_head, max_headers)
    finally:
        PyBuffer_Release(&view)


cdef object _parse_response(const unsigned char *p, Py_ssize_t n, Py_ssize_t max_head,
                            Py_ssize_t max_headers):
    if n == 0:
        return None
    cdef Py_ssize_t i, line_end, end, rs
    cdef int version = 0, r, status
    cdef FieldState st
    r = _parse_version(p, 0, n, &version)
    if r == -1:
        raise ParseError(502, "invalid status line")
    if r == 0:
        return None
    if version // 10 != 1:
        raise ParseError(502, "unsupported HTTP version in response")
    if version > 11:
        version = 11
    if n < 13:
        return None
    if p[8] != 32 or not (48 <= p[9] <= 57 and 48 <= p[10] <= 57 and 48 <= p[11] <= 57):
        raise ParseError(502, "invalid status line")
    status = (p[9] - 48) * 100 + (p[10] - 48) * 10 + (p[11] - 48)
    if status < 100 or status > 599:
        raise ParseError(502, "invalid status code")
    i = 12
    if p[i] == 32:
        i += 1
    elif p[i] != 13:
        raise ParseError(502, "invalid status line")
    rs = i
    while i < n and FVCHAR[p[i]]:
        i += 1
        if i > max_head:
            raise ParseError(502, "status line too long")
    if i >= n or (p[i] == 13 and i + 1 >= n):
        return None
    if p[i] != 13 or p[i + 1] != 10:
        raise ParseError(502, "invalid status line ending")
    line_end = i
    _init_state(&st)
    try:
        end = _scan_fields(p, line_end + 2, n, 0, max_head, max_headers, &st)
    except ParseError as exc:
        if exc.status == 431:  # the scanner's words are a request's
            raise ParseError(502, "response header section too large"
                             if exc.message.endswith("too large")
                             else "too many header fields in response") from None
        raise ParseError(502, "invalid response header section: " + exc.message) from None
    if end < 0:
        return None
    cdef ResponseHead h = ResponseHead.__new__(ResponseHead)
    h._store(p, 0, end, st.nh)
    h.consumed = end
    h.start_line_end = line_end + 2
    h.version = version
    h.status = status
    h.reason = _known_bytes(p + rs, line_end - rs, REASONS)
    try:
        _finish_framing(h, &st, 0)
    except ParseError as exc:
        raise ParseError(502, "invalid response framing: " + exc.message) from None
    return h


cdef enum:
    C_SIZE = 0
    C_SIZE_WS = 1
    C_EXT = 2
    C_SIZE_LF = 3
    C_DATA = 4
    C_DATA_CR = 5
    C_DATA_LF = 6
    C_TRAILER_START = 7
    C_TRAILER_LINE = 8
    C_TRAILER_LF = 9
    C_END_LF = 10
    C_DONE = 11
    C_TRAILER_NAME = 12


# chunk-ext = *( BWS ";" BWS ext-name [ BWS "=" BWS ext-val ] ), ext-name = token,
# ext-val = token / quoted-string (RFC 9112 7.1.1): where C_EXT is in it.
cdef enum:
    X_NAME_START = 0  # after ';', BWS, then a token
    X_NAME = 1
    X_AFTER_NAME = 2  # BWS, then '=', ';' or CR
    X_VALUE_START = 3  # after '=', BWS, then a token or '"'
    X_TOKEN = 4
    X_QUOTED = 5
    X_QUOTED_PAIR = 6  # after '\\' in a quoted string
    X_AFTER_VALUE = 7  # BWS, then ';' or CR


cdef class ChunkedDecoder:
    """Incremental, validating chunked decoder.

    feed(data) returns the payload pieces found in data. When the last chunk and
    trailer section are complete, `done` is set and `tail` is the index in the
    last fed buffer where the next message starts.
    """

    def __init__(self, Py_ssize_t max_trailer=32768, Py_ssize_t max_fields=100):
        self.state = C_SIZE
        self.max_trailer = max_trailer
        self.max_fields = max_fields
        self._trailers = bytearray()

    @property
    def trailers(self) -> bytes:
        return bytes(self._trailers)

    def feed(self, data):
        """Decode data (any contiguous buffer); returns the chunk data pieces as bytes."""
        cdef Py_buffer view
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            return self._feed(data, <const unsigned char *>view.buf, view.len)
        finally:
            PyBuffer_Release(&view)

    cpdef list feed_slab(self, bytearray slab, Py_ssize_t n):
        """feed() of slab[:n], read in place: no buffer taken, no copy of the read."""
        if slab is None or n < 0 or n > PyByteArray_GET_SIZE(slab):
            raise ValueError("feed_slab() needs a bytearray holding n bytes")
        return self._feed(None, <const unsigned char *>PyByteArray_AS_STRING(slab), n)

    cdef int _ext_byte(self, unsigned char c) except -1:
        """One byte of a chunk-ext (state C_EXT); CR where the grammar allows the line
        to end moves on to C_SIZE_LF."""
        cdef int x = self.ext_state
        if x == X_QUOTED:
            if c == 34:  # '"'
                self.ext_state = X_AFTER_VALUE
            elif c == 92:  # '\\'
                self.ext_state = X_QUOTED_PAIR
            elif not FVCHAR[c]:  # qdtext: HTAB, SP, VCHAR but '"' and '\\', obs-text
                raise ParseError(400, "invalid chunk extension")
            return 0
        if x == X_QUOTED_PAIR:
            if not FVCHAR[c]:
                raise ParseError(400, "invalid chunk extension")
            self.ext_state = X_QUOTED
            return 0
        if TCHAR[c]:
            if x == X_NAME_START or x == X_NAME:
                self.ext_state = X_NAME
            elif x == X_VALUE_START or x == X_TOKEN:
                self.ext_state = X_TOKEN
            else:
                raise ParseError(400, "invalid chunk extension")
        elif c == 32 or c == 9:
            if x == X_NAME:
                self.ext_state = X_AFTER_NAME
            elif x == X_TOKEN:
                self.ext_state = X_AFTER_VALUE
        elif c == 61:  # '='
            if x != X_NAME and x != X_AFTER_NAME:
                raise ParseError(400, "invalid chunk extension")
            self.ext_state = X_VALUE_START
        elif c == 34:
            if x != X_VALUE_START:
                raise ParseError(400, "invalid chunk extension")
            self.ext_state = X_QUOTED
        elif c == 59 or c == 13:
            if x != X_NAME and x != X_AFTER_NAME and x != X_TOKEN and x != X_AFTER_VALUE:
                raise ParseError(400, "invalid chunk extension")
            if c == 59:
                self.ext_state = X_NAME_START
            else:
                self.state = C_SIZE_LF
        else:
            raise ParseError(400, "invalid chunk extension")
        return 0

    cdef list _feed(self, object data, const unsigned char *p, Py_ssize_t n):
        cdef Py_ssize_t i = 0, take, ts
        cdef list out = []
        cdef unsigned char c
        cdef int hv
        if self.done:
            raise ParseError(400, "data after the end of a chunked body")
        if n == 0:
            return out
        while i < n:
            c = p[i]
            if self.state == C_DATA:
                take = n - i
                if <unsigned long long>take > self.remaining:
                    take = <Py_ssize_t>self.remaining
                if i == 0 and take == n and type(data) is bytes:
                    out.append(data)
                else:
                    out.append(PyBytes_FromStringAndSize(<const char *>p + i, take))
                i += take
                self.remaining -= take
                if self.remaining == 0:
                    self.state = C_DATA_CR
                continue
            elif self.state == C_SIZE:
                hv = HEXVAL[c]
                if hv >= 0:
                    # chunk-size = 1*HEXDIG: leading zeros are valid, so only significant
                    # digits count against the size; the line itself has a bound.
                    self.digits += 1
                    if self.digits > MAX_CHUNK_EXT:
                        raise ParseError(400, "chunk size line too long")
                    if self.remaining >> (4 * MAX_CHUNK_HEX - 4):
                        raise ParseError(400, "chunk size too large")
                    self.remaining = (self.remaining << 4) | <unsigned long long>hv
                elif self.digits == 0:
                    raise ParseError(400, "invalid chunk size")
                elif c == 13:
                    self.state = C_SIZE_LF
                elif c == 59:  # ';'
                    self.state = C_EXT
                    self.ext_state = X_NAME_START
                elif c == 32 or c == 9:
                    self.state = C_SIZE_WS
                else:
                    raise ParseError(400, "invalid chunk size")
            elif self.state == C_SIZE_WS:
                self.ext_len += 1  # blanks before the ';' count with the extension
                if self.ext_len > MAX_CHUNK_EXT:
                    raise ParseError(400, "chunk size line too long")
                if c == 59:
                    self.state = C_EXT
                    self.ext_state = X_NAME_START
                elif c != 32 and c != 9:
                    raise ParseError(400, "invalid chunk size line")
            elif self.state == C_EXT:
                self.ext_len += 1
                if self.ext_len > MAX_CHUNK_EXT:
                    raise ParseError(400, "chunk extension too long")
                self._ext_byte(c)
            elif self.state == C_SIZE_LF:
                if c != 10:
                    raise ParseError(400, "bare CR in chunk size line")
                self.digits = 0
                self.ext_len = 0
                if self.remaining == 0:
                    self.state = C_TRAILER_START
                else:
                    self.state = C_DATA
            elif self.state == C_DATA_CR:
                if c != 13:
                    raise ParseError(400, "chunk data not followed by CRLF")
                self.state = C_DATA_LF
            elif self.state == C_DATA_LF:
                if c != 10:
                    raise ParseError(400, "chunk data not followed by CRLF")
                self.state = C_SIZE
            elif self.state == C_TRAILER_START:
                if c == 13:
                    self.state = C_END_LF
                elif TCHAR[c]:
                    # Counted as header fields are (431 past max_headers): many tiny
                    # fields cost more to pass on than their bytes say.
                    self.fields += 1
                    if self.fields > self.max_fields:
                        raise ParseError(431, "too many trailer fields")
                    self.state = C_TRAILER_NAME
                    self._trailer_byte(c)
                else:
                    raise ParseError(400, "invalid trailer field")
            elif self.state == C_TRAILER_NAME:
                # field-name ":" (RFC 9112 5.1, 7.1.2): no whitespace before the colon
                if c == 58:
                    self.state = C_TRAILER_LINE
                elif not TCHAR[c]:
                    raise ParseError(400, "invalid trailer field name")
                self._trailer_byte(c)
            elif self.state == C_TRAILER_LINE:
                if c == 13:
                    self.state = C_TRAILER_LF
                elif FVCHAR[c]:
                    self._trailer_byte(c)
                else:
                    raise ParseError(400, "invalid trailer field")
            elif self.state == C_TRAILER_LF:
                if c != 10:
                    raise ParseError(400, "bare CR in trailer section")
                self._trailer_byte(13)
                self._trailer_byte(10)
                self.state = C_TRAILER_START
            elif self.state == C_END_LF:
                if c != 10:
                    raise ParseError(400, "bare CR after last chunk")
                self.state = C_DONE
                self.done = 1
                self.tail = i + 1
                return out
            i += 1
        return out

    cdef inline int _trailer_byte(self, unsigned char c) except -1:
        self.trailer_len += 1
        if self.trailer_len > self.max_trailer:
            raise ParseError(431, "trailer section too large")
        self._trailers.append(c)
        return 0
