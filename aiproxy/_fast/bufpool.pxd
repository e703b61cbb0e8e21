# Read slabs for the protocols (see bufpool.pyx); declared here so compiled callers get
# and return slabs in C.

cdef class BufferPool:
    cdef readonly Py_ssize_t slab_size
    cdef readonly Py_ssize_t max_free
    cdef list _free          # max_free slots; the first _nfree hold slabs
    cdef Py_ssize_t _nfree
    cdef list _held          # [slab, transport, slab, transport, ...]
    cdef readonly Py_ssize_t in_use     # handed out, not yet back (parked included)
    cdef readonly unsigned long long gets
    cdef readonly unsigned long long misses   # gets that had to allocate a slab
    cdef readonly unsigned long long parked   # lends that had to wait for a transport
    cdef readonly unsigned long long dropped  # returned slabs freed: free list full
    cdef Py_ssize_t _skip    # gets before the parked slabs are checked again

    cpdef bytearray get(self)
    cpdef put(self, bytearray slab)
    cpdef bint lend(self, bytearray slab, object transport)
    cpdef Py_ssize_t reclaim(self)


cpdef bytes copy_out(bytearray slab, Py_ssize_t start, Py_ssize_t end)
