"""Writes that reach the socket at once, with no stop in uvloop's write machinery.

uvloop 0.23 tries a write at once when libuv holds nothing for the stream, but on the
way it appends the data to a list (a memoryview cast for anything not bytes), and for
writelines() it builds a _StreamWriteContext with a Py_buffer per piece before the
uv_try_write. Sender.write()/writelines() take a buffer view and call send()/sendmsg()
themselves: under callgrind about 1.2K fewer instructions a small proxied request and
2.6K fewer a 16 KiB one than uvloop 0.23's write path (and under uvloop 0.22, which
queued every write to the end of the loop pass, 2-5K fewer). They send at once only
when that cannot change what the peer receives:

- only on a uvloop TCPTransport: a TLS transport reports a socket too, but bytes sent
  on it would skip the encryption;
- only while the transport has nothing queued (get_write_buffer_size() == 0), so no
  byte overtakes one an earlier write() left behind, and is not closing (uvloop drops
  what is written after close() or abort(); so does this). Only transport.write() and
  writelines() fill that queue, so the Sender asks only while bytes it handed them (or
  that were there when it was made) may still wait: every other write to a transport
  with a Sender goes through Sender.through(), which hands the bytes to transport.write()
  and notes it (tests/test_sendnow.py checks that http1.py and h1_upstream.py write no
  other way). is_closing() is asked before every direct send: uvloop closes a transport
  itself too (an error of its own write);
- never after detach(). uvloop closes the socket right after protocol.connection_lost()
  returns (basetransport.pyx _call_connection_lost), and the descriptor number may then
  belong to another connection: connection_lost() calls detach() first.

What the kernel does not take goes to transport.write() and is queued as before, so
flow control (pause_writing), and the buffer pool's lend() rule, see the same buffer
sizes. A send error hands the bytes to transport.write() too: uvloop meets the error on
its own send and closes the connection its usual way. A send that finds the connection
gone (ECONNRESET, EPIPE: the kernel took none of it, nor will it take anything later) is
kept in `reset`: if it was a request's first write, none of that request reached the
peer, and the request is safe to send again on another connection.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.object cimport PyObject
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from libc.errno cimport EAGAIN, ECONNRESET, EINTR, EPIPE, errno
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memset
from posix.uio cimport iovec

cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    cdef struct msghdr:
        void *msg_name
        socklen_t msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    ssize_t sendmsg(int fd, const msghdr *msg, int flags)
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int MSG_NOSIGNAL, MSG_DONTWAIT, MSG_PEEK
    int getsockopt(int fd, int level, int name, void *value, socklen_t *length)

cdef extern from "<netinet/in.h>" nogil:
    int IPPROTO_TCP

cdef extern from "<netinet/tcp.h>" nogil:
    int TCP_INFO

cdef extern from "<errno.h>" nogil:
    int EWOULDBLOCK

cdef extern from "Python.h":
    bint PyMethod_Check(object)
    PyObject *PyMethod_GET_FUNCTION(object)
    PyObject *PyMethod_GET_SELF(object)
    vectorcallfunc PyVectorcall_Function(PyObject *callable)

cdef enum:
    MAX_PIECES = 16  # writelines() with more pieces goes through the transport

try:
    from uvloop.loop import TCPTransport as _TCP
except ImportError:  # pragma: no cover - uvloop is a dependency
    _TCP = None


cdef void _bind(NoArgs *c, object method):
    """Set c up to call `method` (a bound method of the transport, held elsewhere) with
    no arguments. uvloop's are cyfunctions bound by a method object: their vectorcall
    with the transport as first argument skips the generic call's dispatch (~60
    instructions a call)."""
    c.nargsf = 0
    c.args[0] = NULL
    c.callable = <PyObject *>method
    if PyMethod_Check(method):
        c.callable = PyMethod_GET_FUNCTION(method)
        c.args[0] = PyMethod_GET_SELF(method)
        c.nargsf = 1
    c.vc = PyVectorcall_Function(c.callable)


cdef inline object _call(NoArgs *c):
    if c.vc is not NULL:
        return c.vc(c.callable, c.args, c.nargsf, NULL)
    return PyObject_Vectorcall(c.callable, c.args, c.nargsf, NULL)


cdef int _fd_of(object transport):
    if _TCP is None or type(transport) is not _TCP:
        return -1
    sock = transport.get_extra_info("socket")
    if sock is None:
        return -1
    return sock.fileno()


cdef inline Py_ssize_t _send(int fd, const char *p, Py_ssize_t n):
    """Bytes the kernel took (0 when it would block), or -errno on an error."""
    cdef Py_ssize_t r
    while True:
        r = send(fd, p, <size_t>n, MSG_NOSIGNAL | MSG_DONTWAIT)
        if r >= 0:
            return r
        if errno == EINTR:
            continue
        if errno == EAGAIN or errno == EWOULDBLOCK:
            return 0
        return -errno


cpdef bint unread(int fd) noexcept:
    """True if the socket fd has bytes, an EOF or an error waiting (one non-blocking
    MSG_PEEK). An idle keep-alive connection in that state must not carry a request:
    the peer's FIN may sit in the socket while the loop, running the other callbacks of
    the same pass, has not yet called the connection's eof_received()."""
    cdef char b
    cdef ssize_t r
    while True:
        r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT)
        if r >= 0:
            return True
        if errno != EINTR:
            return not (errno == EAGAIN or errno == EWOULDBLOCK)


# struct tcp_info (linux/tcp.h): tcpi_state is its first byte, tcpi_bytes_sent (Linux
# 4.19+: data bytes sent, retransmissions included) the u64 at this offset.
cdef enum:
    TCPI_BYTES_SENT = 200
    TCPI_SIZE = 256
    TCP_CLOSE_STATE = 7


cpdef long long sent_mark(int fd) noexcept:
    """The TCP socket fd's count of data bytes sent (tcpi_bytes_sent), or -1 where the
    kernel does not report it."""
    cdef unsigned char info[TCPI_SIZE]
    cdef socklen_t n = TCPI_SIZE
    cdef uint64_t sent
    if fd < 0 or getsockopt(fd, IPPROTO_TCP, TCP_INFO, info, &n) != 0 \
            or n < TCPI_BYTES_SENT + 8:
        return -1
    memcpy(&sent, info + TCPI_BYTES_SENT, 8)
    return <long long>sent


cpdef bint closed_unsent(int fd, long long mark) noexcept:
    """True if the socket fd is closed (TCP_CLOSE: a reset came in, nothing more will go
    out) and has sent no data byte since sent_mark() returned `mark`: nothing written to
    it after the mark reached the peer."""
    cdef unsigned char info[TCPI_SIZE]
    cdef socklen_t n = TCPI_SIZE
    cdef uint64_t sent
    if mark < 0 or fd < 0 or getsockopt(fd, IPPROTO_TCP, TCP_INFO, info, &n) != 0 \
            or n < TCPI_BYTES_SENT + 8:
        return False
    memcpy(&sent, info + TCPI_BYTES_SENT, 8)
    return info[0] == TCP_CLOSE_STATE and <long long>sent == mark


cdef class Sender:
    """write()/writelines() for one transport (see the module docstring).

    Fields: sent_now, sent_queued: writes sent in full at once, and writes that went
    (at least in part) through transport.write(): for tests and the curious. reset: the
    errno (ECONNRESET or EPIPE) of a send that found the connection gone, else 0."""

    def __init__(self, transport: object) -> None:
        self.fd = _fd_of(transport)
        self._write = transport.write
        self._writelines = transport.writelines
        self._queued = transport.get_write_buffer_size
        self._closing = transport.is_closing
        _bind(&self._queued_c, self._queued)
        _bind(&self._closing_c, self._closing)
        self.pending = True  # what the transport holds from before is unknown
        # uvloop's TLS transport drops what is written once it is closing (the client's
        # close_notify, its socket lost, close()), and past the fifth such write logs
        # "SSL connection is closed" each time: drop it here, without the log.
        self.tls = transport.get_extra_info("sslcontext") is not None

    @property
    def direct(self) -> bool:
        """Whether writes may go to the socket at once."""
        return self.fd >= 0

    cpdef detach(self):
        """Never touch the socket again (call before the transport closes it)."""
        self.fd = -1

    cpdef through(self, object data):
        """transport.write(data), noting that the transport may now hold bytes: later
        writes queue behind them. Every write that must not go to the socket at once
        (and every write of code that holds the transport) goes this way, never to
        transport.write() itself."""
        self.pending = True
        self._write(data)

    cdef inline bint _must_queue(self) except -1:
        if self.fd < 0:
            return True
        if self.pending:
            if _call(&self._queued_c):
                return True
            self.pending = False  # drained: no need to ask again until the next queueing
        return bool(_call(&self._closing_c))

    cpdef write(self, object data):
        cdef Py_buffer view
        cdef Py_ssize_t n, sent
        if self._must_queue():
            if self.tls and self._closing():
                return
            self.sent_queued += 1
            self.pending = True
            self._write(data)
            return
        if PyBytes_CheckExact(data):
            n = PyBytes_GET_SIZE(data)
            if n == 0:
                return
            sent = _send(self.fd, PyBytes_AS_STRING(data), n)
        else:
            PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
            n = view.len
            try:
                if n == 0:
                    return
                sent = _send(self.fd, <const char *>view.buf, n)
            finally:
                PyBuffer_Release(&view)
        if sent == n:
            self.sent_now += 1
            return
        self.sent_queued += 1
        if sent == -ECONNRESET or sent == -EPIPE:
            self.reset = -sent
        self.pending = True
        if sent <= 0:
            self._write(data)  # would block, or an error for uvloop to meet
        else:
            self._write(memoryview(data).cast("B")[sent:])

    cpdef writelines(self, object pieces):
        cdef Py_buffer views[MAX_PIECES]
        cdef iovec iov[MAX_PIECES]
        cdef msghdr msg
        cdef Py_ssize_t total = 0, sent, k
        cdef int count = 0, i
        if len(pieces) > MAX_PIECES or self._must_queue():
            if self.tls and self._closing():
                return
            self.sent_queued += 1
            self.pending = True
            self._writelines(pieces)
            return
        try:
            for piece in pieces:
                PyObject_GetBuffer(piece, &views[count], PyBUF_SIMPLE)
                iov[count].iov_base = views[count].buf
                iov[count].iov_len = <size_t>views[count].len
                total += views[count].len
                count += 1
            if total == 0:
                return
            memset(&msg, 0, sizeof(msg))
            msg.msg_iov = iov
            msg.msg_iovlen = <size_t>count
            while True:
                sent = sendmsg(self.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
                if sent >= 0 or errno != EINTR:
                    break
            if sent < 0:
                if errno == EAGAIN or errno == EWOULDBLOCK:
                    sent = 0
                elif errno == ECONNRESET or errno == EPIPE:
                    self.reset = errno
        finally:
            for i in range(count):
                PyBuffer_Release(&views[i])
        if sent == total:
            self.sent_now += 1
            return
        self.sent_queued += 1
        self.pending = True
        if sent <= 0:
            self._writelines(pieces)
            return
        rest = []
        for piece in pieces:
            if sent == 0:
                rest.append(piece)
                continue
            view = memoryview(piece).cast("B")
            k = len(view)
            if sent >= k:
                sent -= k
            else:
                rest.append(view[sent:])
                sent = 0
        self._writelines(rest)
