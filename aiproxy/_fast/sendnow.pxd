# cimport this for C calls to Sender; sendnow.pyx says when a write goes out at once.

# C calls from h1_upstream (the pool checks each idle connection before reuse).
cpdef bint unread(int fd) noexcept
cpdef long long sent_mark(int fd) noexcept
cpdef bint closed_unsent(int fd, long long mark) noexcept


cdef class Sender:
    cdef int fd
    cdef readonly bint tls
    cdef object _write, _writelines, _queued, _closing
    cdef readonly unsigned long long sent_now, sent_queued
    cdef readonly int reset

    cpdef detach(self)
    cpdef write(self, object data)
    cpdef writelines(self, object pieces)
