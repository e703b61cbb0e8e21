# cimport this for the C call; clock.pyx says which clock it is, and what the event stamp is.

cpdef double monotonic() noexcept nogil
cpdef double event_begin() noexcept
cpdef void event_end() noexcept
cpdef double event_now() noexcept
