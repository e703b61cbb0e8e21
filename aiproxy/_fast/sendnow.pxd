# cimport this for C calls to Sender; sendnow.pyx says when a write goes out at once.

# C calls from h1_upstream (the pool checks each idle connection before reuse).
cpdef bint unread(int fd) noexcept
cpdef long long sent_mark(int fd) noexcept
cpdef bint closed_unsent(int fd, long long mark) noexcept


from cpython.object cimport PyObject

cdef extern from "Python.h":
    ctypedef object (*vectorcallfunc)(PyObject *callable, PyObject **args, size_t nargsf,
                                      PyObject *kwnames)
    object PyObject_Vectorcall(PyObject *callable, PyObject **args, size_t nargsf,
                               PyObject *kwnames)

ctypedef struct NoArgs:  # a call of a bound method without arguments (sendnow.pyx _bind)
    vectorcallfunc vc
    PyObject *callable
    PyObject *args[1]
    size_t nargsf


cdef class Sender:
    cdef int fd
    cdef readonly bint tls
    cdef object _write, _writelines, _queued, _closing
    cdef NoArgs _queued_c, _closing_c
    cdef bint pending  # the transport may hold bytes: ask get_write_buffer_size()
    cdef readonly unsigned long long sent_now, sent_queued
    cdef readonly int reset

    cpdef detach(self)
    cpdef through(self, object data)
    cdef bint _must_queue(self) except -1
    cpdef write(self, object data)
    cpdef writelines(self, object pieces)
