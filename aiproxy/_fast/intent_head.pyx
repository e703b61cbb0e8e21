# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The intent model's graph evaluated in C, for one text at a time.

The trainer (aiproxy.semantic.export) writes one graph: an embedding bag over an int8
table with a per-class scale, a softmax, an L2-normalised copy of the logits and a
top-k. onnxruntime runs it in 25-50 us a call, most of it per-node dispatch around
about 15K multiply-adds. `LinearHead` computes the same outputs from the same
initializers in a few microseconds:

    logits[c] = scale[c] * sum_j weights[j] * T[ids[j], c]      (Gather, Cast, MatMul, Mul)
    probs = softmax(logits); embedding = logits / ||logits||_2  (Softmax, LpNormalization)
    top_p, top_i = the k largest probs, largest first, ties to the lower index (TopK)

aiproxy.semantic.classifier uses it only after checking the ONNX graph is exactly that
one, and tests/test_intent_head.py compares it with onnxruntime on the validation split.
"""

from libc.math cimport expf, sqrtf
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

import numpy as np

cimport numpy as cnp

cnp.import_array()


cdef extern from *:
    """
    /* The embedding bag: acc[c] += w[j] * table[ids[j]][c] over the rows.

       restrict: a signed char pointer may alias anything, which would keep the
       compiler from vectorizing the inner loop. On x86-64 a second copy is built for
       AVX2 (8 lanes), picked when the module loads.

       Under proxy load the 3 MiB table is mostly out of cache and each row is a few
       cache misses: the loop asks for the row PREFETCH_AHEAD rows ahead so the misses
       overlap instead of coming one after another. */
    #define AIPROXY_PREFETCH_AHEAD 8
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __attribute__((target_clones("avx2", "default")))
    #endif
    static void aiproxy_bag_i8(float *__restrict acc, const signed char *table,
                               Py_ssize_t stride, const int64_t *ids, const float *w,
                               Py_ssize_t n, Py_ssize_t classes) {
        for (Py_ssize_t j = 0; j < n; j++) {
            if (j + AIPROXY_PREFETCH_AHEAD < n) {
                const char *next = (const char *)(table + ids[j + AIPROXY_PREFETCH_AHEAD] * stride);
                for (Py_ssize_t off = 0; off < classes; off += 64)
                    __builtin_prefetch(next + off);
                __builtin_prefetch(next + classes - 1);
            }
            const signed char *__restrict row = table + ids[j] * stride;
            const float wj = w[j];
            for (Py_ssize_t c = 0; c < classes; c++)
                acc[c] += wj * (float)row[c];
        }
    }
    """
    void bag_i8 "aiproxy_bag_i8"(float *acc, const signed char *table, Py_ssize_t stride,
                                 const int64_t *ids, const float *w, Py_ssize_t n,
                                 Py_ssize_t classes) noexcept nogil


cdef class LinearHead:
    cdef const signed char[:, ::1] table
    cdef const float[::1] scale
    cdef float *acc
    cdef unsigned char *picked
    cdef const int64_t *ids
    cdef const float *weights
    cdef Py_ssize_t cap
    cdef object inputs  # the bound arrays, kept alive
    cdef readonly int rows
    cdef readonly int classes

    def __cinit__(self):
        self.acc = NULL
        self.picked = NULL
        self.ids = NULL
        self.weights = NULL
        self.cap = 0

    def __init__(self, table, scale):
        table = np.ascontiguousarray(table, dtype=np.int8)
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        if table.ndim != 2 or scale.ndim != 1 or scale.shape[0] != table.shape[1]:
            raise ValueError(f"table {table.shape} and scale {scale.shape} do not match")
        self.table = table
        self.scale = scale
        self.rows = table.shape[0]
        self.classes = table.shape[1]
        self.acc = <float *>malloc(self.classes * sizeof(float))
        self.picked = <unsigned char *>malloc(self.classes)
        if self.acc == NULL or self.picked == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.acc)
        free(self.picked)

    def bind(self, const int64_t[::1] ids not None, const float[::1] weights not None):
        """The input buffers `run` reads (the caller refills them per text)."""
        if ids.shape[0] != weights.shape[0]:
            raise ValueError("ids and weights differ in length")
        self.inputs = (ids.base, weights.base)
        self.ids = &ids[0]
        self.weights = &weights[0]
        self.cap = ids.shape[0]

    def run(self, Py_ssize_t n, int k):
        """(top_p, top_i, embedding) of the first n (id, weight) pairs of the bound
        buffers: two lists of k and a new float32 array of the classes."""
        cdef Py_ssize_t j, c, C = self.classes, rows = self.rows
        cdef float *acc = self.acc
        cdef float m, total, norm, v
        cdef int64_t i
        cdef cnp.npy_intp dims[1]
        if self.ids == NULL:
            raise ValueError("no input buffers bound")
        if n < 0 or n > self.cap:
            raise ValueError(f"n must be in 0..{self.cap}")
        if k < 1 or k > C:
            raise ValueError(f"k must be in 1..{C}")
        for c in range(C):
            acc[c] = 0.0
        for j in range(n):
            i = self.ids[j]
            if i < 0 or i >= rows:
                raise IndexError(f"feature id {i} is outside the table (0..{rows - 1})")
        bag_i8(acc, &self.table[0, 0], self.table.strides[0], self.ids, self.weights, n, C)
        m = -3.4e38
        norm = 0.0
        for c in range(C):
            v = acc[c] * self.scale[c]
            acc[c] = v
            norm += v * v
            if v > m:
                m = v
        dims[0] = C
        embedding = cnp.PyArray_EMPTY(1, dims, cnp.NPY_FLOAT32, 0)
        cdef float *emb = <float *>cnp.PyArray_DATA(embedding)
        norm = sqrtf(norm)
        if norm == 0.0:
            for c in range(C):
                emb[c] = 0.0
        else:
            for c in range(C):
                emb[c] = acc[c] / norm
        total = 0.0
        for c in range(C):
            total += expf(acc[c] - m)
        top_i = []
        top_p = []
        cdef Py_ssize_t best, t
        cdef float bv
        memset(self.picked, 0, C)
        for t in range(k):
            best = -1
            bv = 0.0
            for c in range(C):
                # strictly greater: the lower index wins a tie, as in TopK
                if not self.picked[c] and (best < 0 or acc[c] > bv):
                    best = c
                    bv = acc[c]
            self.picked[best] = 1
            top_i.append(best)
            top_p.append(expf(bv - m) / total)
        return top_p, top_i, embedding
