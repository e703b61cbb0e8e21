# Fields in histogram.pyx's comment; declared here so compiled callers observe() in C.

cdef enum:
    MAX_BUCKETS = 64


cdef class Histogram:
    cdef double bounds[MAX_BUCKETS]
    cdef long long counts_[MAX_BUCKETS + 1]
    cdef int n
    cdef readonly tuple buckets
    cdef public double sum

    cpdef void observe(self, double value)
