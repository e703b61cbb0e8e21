# Intent vectorizer: hashed word/character n-grams and structured slots (see intent.pyx).

from libc.stdint cimport int64_t, uint64_t


cdef class Vectorizer:
    cdef readonly long long buckets
    cdef readonly unsigned long long seed
    cdef readonly int word_ngrams
    cdef readonly int char_min
    cdef readonly int char_max
    cdef readonly Py_ssize_t max_features
    cdef readonly int dims
    cdef readonly int text_start
    cdef readonly int text_end
    cdef readonly bint sqrt_pool
    cdef readonly tuple slots          # ((name, start, width), ...)
    cdef uint64_t base                 # fmix64(seed ^ golden): the empty-text feature
    cdef uint64_t table[256]           # seeded byte -> word table of the polynomial hash
    cdef uint64_t *scratch             # max_features raw hashes

    cdef Py_ssize_t _scan(self, const unsigned char *p, Py_ssize_t n,
                          uint64_t *out, Py_ssize_t cap, uint64_t nb) noexcept nogil
    cdef Py_ssize_t _ids(self, object text, int64_t *out, Py_ssize_t cap) except -1
    cdef uint64_t _slot_hash(self, str name, object value) except? 0
    cpdef Py_ssize_t encode_into(self, object text, int64_t[::1] ids, float[::1] weights) except -1
