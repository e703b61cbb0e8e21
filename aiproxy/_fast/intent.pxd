# Intent vectorizer: hashed word/character n-grams and structured slots (see intent.pyx).

from libc.stdint cimport int32_t, int64_t, uint64_t


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
    # optional word vocabulary (pretrained word vectors): word hash -> id, open addressing
    cdef readonly Py_ssize_t vocabulary_size
    cdef uint64_t *vkeys               # word hashes (0: empty slot)
    cdef int32_t *vvals                # vocabulary index of each key
    cdef uint64_t vmask                # table size - 1 (a power of two)
    cdef int64_t *vbuf                 # max_features vocabulary ids of the last scan
    cdef Py_ssize_t vcnt               # how many in vbuf
    cdef Py_ssize_t last_ngrams        # n-gram ids in the last _ids output (the rest: words)

    cdef Py_ssize_t _scan(self, const unsigned char *p, Py_ssize_t n,
                          uint64_t *out, Py_ssize_t cap, uint64_t nb) noexcept nogil
    cdef Py_ssize_t _ids(self, object text, int64_t *out, Py_ssize_t cap) except -1
    cdef void _weights(self, Py_ssize_t cnt, float *w) noexcept
    cdef uint64_t _slot_hash(self, str name, object value) except? 0
    cpdef Py_ssize_t encode_into(self, object text, int64_t[::1] ids, float[::1] weights) except -1
