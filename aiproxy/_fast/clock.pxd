# cimport this for the C call; clock.pyx says which clock it is.

cpdef double monotonic() noexcept nogil
