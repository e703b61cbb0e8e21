"""Read buffers for the HTTP/1.1 protocols: fixed-size slabs reused across reads.

A connection's get_buffer() takes a slab, the bytes are parsed in place and body
bytes go to the other connection's transport as memoryview slices of it; then the
slab comes back with lend(slab, transport).

Reusing a slab is safe only when no transport will still read from it. What a
transport does with a buffer it could not send at once (uvloop 0.23,
uvloop/handles/stream.pyx; the same for asyncio's selector transports):
- write()/writelines() with nothing queued try the send right away. Sent in full,
  the buffer is dropped before write() returns and get_write_buffer_size() is 0.
- Otherwise the unsent rest stays referenced (the transport's _buffer, then a
  _StreamWriteContext holding the Py_buffer until libuv's write callback; TLS
  keeps it in the SSL write backlog), and counts in get_write_buffer_size()
  until it has been handed to the kernel (libuv lowers write_queue_size as
  bytes are written; the backlog shrinks as it is encrypted).
So "get_write_buffer_size() == 0" after the writes means every byte taken from the
slab has left it: lend() recycles the slab then, and otherwise parks it with the
transport until that transport reports 0 (or is gone: a closed uvloop handle
reports 0 and writes nothing more). A parked slab is never handed out again
before that.

Slabs are bytearrays: a view a transport may still keep (until its write callback
releases it) keeps the memory alive; the pool never resizes a slab.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_FromStringAndSize


cdef class BufferPool:
    """Slabs of slab_size bytes; at most max_free are kept for reuse (fields: bufpool.pxd)."""

    def __init__(self, Py_ssize_t slab_size=65536, Py_ssize_t max_free=64):
        if slab_size <= 0 or max_free < 0:
            raise ValueError("slab_size must be positive and max_free not negative")
        self.slab_size = slab_size
        self.max_free = max_free
        # A stack of max_free slots, _nfree of them filled: it never resizes. A list
        # used with append()/pop() reallocated on every get and put while it swung
        # between 0 and 1 slabs (all but one in use), ~0.9K instructions a request.
        self._free = [None] * max_free
        self._nfree = 0
        self._held = []

    cpdef bytearray get(self):
        """A slab for one read; back with put() or lend()."""
        cdef bytearray slab
        self.gets += 1
        self.in_use += 1
        if self._held:
            # Parked slabs are checked every (number parked)th get: O(1) per get on
            # average, and a parked slab is back soon after its transport drained.
            if self._skip > 0:
                self._skip -= 1
            else:
                self.reclaim()
                self._skip = len(self._held) >> 1
        if self._nfree:
            self._nfree -= 1
            slab = <bytearray>self._free[self._nfree]
            self._free[self._nfree] = None
            return slab
        self.misses += 1
        return bytearray(self.slab_size)

    cpdef put(self, bytearray slab):
        """A slab nothing else refers to any more."""
        self.in_use -= 1
        if self._nfree < self.max_free and len(slab) == self.slab_size:
            self._free[self._nfree] = slab
            self._nfree += 1
        else:
            self.dropped += 1

    cpdef bint lend(self, bytearray slab, object transport):
        """Return a slab whose bytes were written to transport (as views). Recycled now
        when the transport holds nothing unsent (True), else parked until it does."""
        if transport is None or transport.get_write_buffer_size() == 0:
            self.put(slab)
            return True
        self.parked += 1
        self._held.append(slab)
        self._held.append(transport)
        return False

    cpdef Py_ssize_t reclaim(self):
        """Recycle the parked slabs whose transports have sent everything; returns how many."""
        cdef list held = self._held
        cdef list keep = []
        cdef Py_ssize_t i, n = len(held), freed = 0
        for i in range(0, n, 2):
            transport = held[i + 1]
            if transport.get_write_buffer_size() == 0:
                self.put(<bytearray>held[i])
                freed += 1
            else:
                keep.append(held[i])
                keep.append(transport)
        self._held = keep
        return freed

    @property
    def free(self) -> int:
        return self._nfree

    @property
    def held(self) -> int:
        """Slabs waiting for a transport to send what it took from them."""
        return len(self._held) >> 1

    def stats(self) -> dict:
        return {"slab_size": self.slab_size, "in_use": self.in_use, "free": self._nfree,
                "held": len(self._held) >> 1, "gets": self.gets, "misses": self.misses,
                "parked": self.parked, "dropped": self.dropped}


# One pool per process (workers are processes); 64 KiB slabs: a whole small message
# or a large share of a socket buffer per read.
POOL = BufferPool(65536, 64)


cpdef bytes copy_out(bytearray slab, Py_ssize_t start, Py_ssize_t end):
    """bytes of slab[start:end] (one copy, no intermediate objects)."""
    if start < 0 or end > len(slab) or start > end:
        raise IndexError("slab range out of bounds")
    return PyBytes_FromStringAndSize(PyByteArray_AS_STRING(slab) + start, end - start)
