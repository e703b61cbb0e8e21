# Compiled by Cython in pure-Python mode (setup.py): access_log.py is the source. The
# recorder builds a record per request with these in C.

cdef long long _second
cdef str _second_text
cdef tuple _MILLIS

cpdef bytes encode_line(dict record)
cpdef str iso_now()
cpdef double ms(double seconds)
