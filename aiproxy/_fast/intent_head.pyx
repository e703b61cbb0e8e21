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

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.math cimport fabs, floor, lrint, sqrtf
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

import numpy as np

cimport numpy as cnp

from aiproxy._fast.intent cimport Vectorizer

cnp.import_array()

DEF TOPK_MAX = 32


ctypedef void (*bag_fn)(float *acc, short *sums, const signed char *table,
                        Py_ssize_t stride, const int64_t *ids, const float *w,
                        Py_ssize_t n) noexcept nogil


cdef extern from *:
    """
    #include <string.h>

    /* The embedding bag: acc[c] += w[j] * table[ids[j]][c] over the rows.

       The trainer's pooling gives every feature of a kind the same weight, so the rows
       come in runs of one weight. A run's int8 rows are summed exactly in int16 (256
       rows of at most 128 each fit) and multiplied by the weight once: integer adds
       instead of a convert and a multiply-add per column. The table is copied with its
       rows padded with zeros to a multiple of AIPROXY_LANES columns, so no loop has a
       tail.

       Under proxy load the table is mostly out of cache and each row is a few cache
       misses: the loops ask for the row PREFETCH_AHEAD rows ahead so the misses overlap
       instead of coming one after another. */
    #define AIPROXY_LANES 16
    #define AIPROXY_RUN_MAX 256
    #define AIPROXY_PREFETCH_AHEAD 8

    static inline void aiproxy_prefetch_row(const signed char *table, Py_ssize_t stride,
                                            const int64_t *ids, Py_ssize_t j) {
        const char *row = (const char *)(table + ids[j] * stride);
        for (Py_ssize_t off = 0; off < stride; off += 64)
            __builtin_prefetch(row + off);
        __builtin_prefetch(row + stride - 1);
    }

    /* Length of the run of equal weights that starts at j0 (at most RUN_MAX). */
    static inline Py_ssize_t aiproxy_run_end(const float *w, Py_ssize_t j0, Py_ssize_t n) {
        Py_ssize_t j1 = j0 + 1;
        while (j1 < n && j1 - j0 < AIPROXY_RUN_MAX && w[j1] == w[j0])
            j1++;
        return j1;
    }

    static void aiproxy_bag_portable(float *__restrict acc, short *__restrict sums,
                                     const signed char *table, Py_ssize_t stride,
                                     const int64_t *ids, const float *w, Py_ssize_t n) {
        for (Py_ssize_t j0 = 0, j1; j0 < n; j0 = j1) {
            j1 = aiproxy_run_end(w, j0, n);
            memset(sums, 0, stride * sizeof(short));
            for (Py_ssize_t j = j0; j < j1; j++) {
                if (j + AIPROXY_PREFETCH_AHEAD < n)
                    aiproxy_prefetch_row(table, stride, ids, j + AIPROXY_PREFETCH_AHEAD);
                const signed char *__restrict row = table + ids[j] * stride;
                for (Py_ssize_t c = 0; c < stride; c++)
                    sums[c] += row[c];
            }
            for (Py_ssize_t c = 0; c < stride; c++)
                acc[c] += w[j0] * (float)sums[c];
        }
    }

    typedef void (*aiproxy_bag_fn)(float *, short *, const signed char *, Py_ssize_t,
                                   const int64_t *, const float *, Py_ssize_t);

    #if defined(__x86_64__) && defined(__GNUC__)
    #include <immintrin.h>
    #define AIPROXY_BLOCK_MAX 10  /* 160 columns (the builtin model's 151) in registers */

    /* sums[c .. c + 16 nv) = the column sums of rows ids[j0 .. j1), nv vectors of 16
       int16 held in registers over the rows; nv is a constant where it is inlined. */
    __attribute__((target("avx2"), always_inline))
    static inline void aiproxy_block_avx2(short *sums, const signed char *table,
                                          Py_ssize_t stride, Py_ssize_t c,
                                          const int64_t *ids, Py_ssize_t j0,
                                          Py_ssize_t j1, Py_ssize_t n, const int nv) {
        __m256i s[AIPROXY_BLOCK_MAX];
        for (int v = 0; v < nv; v++)
            s[v] = _mm256_setzero_si256();
        for (Py_ssize_t j = j0; j < j1; j++) {
            if (c == 0 && j + AIPROXY_PREFETCH_AHEAD < n)
                aiproxy_prefetch_row(table, stride, ids, j + AIPROXY_PREFETCH_AHEAD);
            const signed char *row = table + ids[j] * stride + c;
            for (int v = 0; v < nv; v++)
                s[v] = _mm256_add_epi16(s[v], _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(row + 16 * v))));
        }
        for (int v = 0; v < nv; v++)
            _mm256_storeu_si256((__m256i *)(sums + c + 16 * v), s[v]);
    }

    __attribute__((target("avx2")))
    static void aiproxy_bag_avx2(float *__restrict acc, short *__restrict sums,
                                 const signed char *table, Py_ssize_t stride,
                                 const int64_t *ids, const float *w, Py_ssize_t n) {
        for (Py_ssize_t j = 0; j < AIPROXY_PREFETCH_AHEAD && j < n; j++)
            aiproxy_prefetch_row(table, stride, ids, j);
        for (Py_ssize_t j0 = 0, j1; j0 < n; j0 = j1) {
            j1 = aiproxy_run_end(w, j0, n);
            for (Py_ssize_t c = 0; c < stride; c += AIPROXY_BLOCK_MAX * AIPROXY_LANES) {
                switch ((stride - c) / AIPROXY_LANES) {
                #define AIPROXY_NV(k) \
                    case k: aiproxy_block_avx2(sums, table, stride, c, ids, j0, j1, n, k); break;
                AIPROXY_NV(1) AIPROXY_NV(2) AIPROXY_NV(3) AIPROXY_NV(4) AIPROXY_NV(5)
                AIPROXY_NV(6) AIPROXY_NV(7) AIPROXY_NV(8) AIPROXY_NV(9)
                #undef AIPROXY_NV
                default:
                    aiproxy_block_avx2(sums, table, stride, c, ids, j0, j1, n,
                                       AIPROXY_BLOCK_MAX);
                }
            }
            const __m256 wj = _mm256_set1_ps(w[j0]);
            for (Py_ssize_t c = 0; c < stride; c += 8) {
                __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(
                    _mm_loadu_si128((const __m128i *)(sums + c))));
                _mm256_storeu_ps(acc + c, _mm256_add_ps(_mm256_loadu_ps(acc + c),
                                                        _mm256_mul_ps(wj, x)));
            }
        }
    }

    static aiproxy_bag_fn aiproxy_bag_best(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") ? aiproxy_bag_avx2 : aiproxy_bag_portable;
    }
    #else
    static aiproxy_bag_fn aiproxy_bag_best(void) { return aiproxy_bag_portable; }
    #endif

    /* exp(x) for x <= 0 (a logit minus the largest), 8 at a time, relative error about
       1e-7: x = n ln2 + r with |r| <= ln2/2, Cephes' polynomial for e^r, 2^n put in the
       exponent bits. Below -87 the result would be subnormal; it is clamped there, at
       1e-38 of the largest term. GCC's vector extensions: AVX or SSE2 as compiled. */
    typedef float aiproxy_v8f __attribute__((vector_size(32)));
    typedef int aiproxy_v8i __attribute__((vector_size(32)));

    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __attribute__((target_clones("avx2", "default")))
    #endif
    static float aiproxy_exp_sum(float *__restrict e, const float *__restrict x,
                                 float m, Py_ssize_t n) {
        /* e[c] = exp(x[c] - m) for c < n; returns their sum. x and e have room for n
           rounded up to 8 (what is computed past n is not counted). */
        const aiproxy_v8f lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
        for (Py_ssize_t c = 0; c < n; c += 8) {
            aiproxy_v8f v;
            memcpy(&v, x + c, sizeof v);
            v -= m;
            aiproxy_v8i low = v < lo;
            v = (aiproxy_v8f)(((aiproxy_v8i)lo & low) | ((aiproxy_v8i)v & ~low));
            const aiproxy_v8f k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
            aiproxy_v8f r = v - k * 0.693359375f;
            r = r + k * 2.12194440e-4f;
            aiproxy_v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
            p = p * r + 8.3334519073e-3f;
            p = p * r + 4.1665795894e-2f;
            p = p * r + 1.6666665459e-1f;
            p = p * r + 5.0000001201e-1f;
            p = p * r * r + r + 1.0f;
            aiproxy_v8i bits = (__builtin_convertvector(k, aiproxy_v8i) + 127) << 23;
            v = p * (aiproxy_v8f)bits;
            memcpy(e + c, &v, sizeof v);
        }
        aiproxy_v8f part = {0};
        Py_ssize_t c = 0;
        for (; c + 8 <= n; c += 8) {
            aiproxy_v8f v;
            memcpy(&v, e + c, sizeof v);
            part += v;
        }
        float total = 0.0f;
        for (; c < n; c++)
            total += e[c];
        for (int l = 0; l < 8; l++)
            total += part[l];
        return total;
    }

    /* acc[c] *= scale[c] over the padded width n (a multiple of 8; the padding's scale
       is 0); returns the sum of squares of the result. */
    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __attribute__((target_clones("avx2", "default")))
    #endif
    static float aiproxy_scale_norm2(float *__restrict acc, const float *__restrict scale,
                                     Py_ssize_t n) {
        aiproxy_v8f sq = {0};
        for (Py_ssize_t c = 0; c < n; c += 8) {
            aiproxy_v8f a, s;
            memcpy(&a, acc + c, sizeof a);
            memcpy(&s, scale + c, sizeof s);
            a *= s;
            sq += a * a;
            memcpy(acc + c, &a, sizeof a);
        }
        float total = 0.0f;
        for (int l = 0; l < 8; l++)
            total += sq[l];
        return total;
    }
    """
    void bag_portable "aiproxy_bag_portable"(float *acc, short *sums,
                                             const signed char *table, Py_ssize_t stride,
                                             const int64_t *ids, const float *w,
                                             Py_ssize_t n) noexcept nogil
    bag_fn bag_best "aiproxy_bag_best"() noexcept nogil
    float exp_sum "aiproxy_exp_sum"(float *e, const float *x, float m,
                                    Py_ssize_t n) noexcept nogil
    float scale_norm2 "aiproxy_scale_norm2"(float *acc, const float *scale,
                                            Py_ssize_t n) noexcept nogil
    int LANES "AIPROXY_LANES"
    void *aligned_alloc(size_t alignment, size_t size) nogil


cdef bag_fn BEST_BAG = bag_best()


cdef inline bint _digits4(double confidence, char *out) noexcept:
    """The six bytes b"%.4f" % confidence gives for a probability, into out; False where
    this cannot tell (not a probability, or near a tie at the fourth decimal, where the
    product below may have rounded). A float32 probability times 10,000 is exact in a
    double, so lrint's ties-to-even gives %.4f's digits."""
    cdef double x = confidence * 10000.0
    cdef long n
    if not 0.0 <= confidence <= 1.0 or fabs(x - floor(x) - 0.5) < 1e-6:
        return False
    n = lrint(x)
    out[0] = c'1' if n == 10000 else c'0'
    out[1] = c'.'
    out[2] = <char>(48 + n // 1000 % 10)
    out[3] = <char>(48 + n // 100 % 10)
    out[4] = <char>(48 + n // 10 % 10)
    out[5] = <char>(48 + n % 10)
    return True


def confidence_text(double confidence) -> bytes:
    """b"%.4f" % confidence, without the float formatting machinery for a probability
    (a tenth of its cost)."""
    cdef char out[6]
    if not _digits4(confidence, out):
        return b"%.4f" % confidence
    return PyBytes_FromStringAndSize(out, 6)


cdef class DecisionLines:
    """Called with (intent, domain, confidence): the x-aiproxy-intent* fields of an
    HTTP/1.1 upstream request head. The lines of an (intent, domain) are made once (a
    model has a few hundred labels; explicit intents from clients are not kept past
    `limit`), and each call copies them and the confidence into one bytes object."""
    cdef dict cache
    cdef Py_ssize_t limit

    def __init__(self, Py_ssize_t limit=4096):
        self.cache = {}
        self.limit = limit

    def __call__(self, str intent not None, str domain, double confidence) -> bytes:
        cdef bytes lines = self.cache.get((intent, domain))
        cdef char digits[6]
        cdef Py_ssize_t k
        cdef char *out
        if lines is None:
            lines = b"x-aiproxy-intent: " + intent.encode() + b"\r\n"
            if domain:
                lines += b"x-aiproxy-intent-domain: " + domain.encode() + b"\r\n"
            lines += b"x-aiproxy-intent-confidence: "
            if len(self.cache) < self.limit:
                self.cache[(intent, domain)] = lines
        if not _digits4(confidence, digits):
            return lines + b"%.4f\r\n" % confidence
        k = len(lines)
        result = PyBytes_FromStringAndSize(NULL, k + 8)
        out = PyBytes_AS_STRING(result)
        memcpy(out, <const char *>lines, k)
        memcpy(out + k, digits, 6)
        out[k + 6] = c'\r'
        out[k + 7] = c'\n'
        return result


cdef object unit_array(const float *logits, Py_ssize_t C, float norm):
    """A new float32 array: logits / norm (zeros when norm is 0), as LpNormalization."""
    cdef cnp.npy_intp dims[1]
    cdef Py_ssize_t c
    dims[0] = C
    embedding = cnp.PyArray_EMPTY(1, dims, cnp.NPY_FLOAT32, 0)
    cdef float *emb = <float *>cnp.PyArray_DATA(embedding)
    if norm == 0.0:
        memset(emb, 0, C * sizeof(float))
    else:
        for c in range(C):
            emb[c] = logits[c] / norm
    return embedding


cdef class Decision:
    """What the model says about one text: the label (the out-of-scope label below the
    threshold), its probability, its domain, the top k (label, probability) pairs
    (largest first) and the embedding (the L2-normalised logits the caches use).

    LinearHead's Decisions build `top` and `embedding` when first read: the proxy routes
    on the label alone, and a numpy array per request is most of a decision's cost."""
    cdef public str label
    cdef public double confidence
    cdef public str domain
    cdef object _top
    cdef object _embedding
    cdef bytes _logits  # the C floats the embedding is made of, until it is made
    cdef float _norm
    cdef list _labels  # the head's labels, for top
    cdef int _k
    cdef int _best[TOPK_MAX]
    cdef float _probs[TOPK_MAX]

    def __init__(self, str label, double confidence, str domain, list top, embedding):
        self.label = label
        self.confidence = confidence
        self.domain = domain
        self._top = top
        self._embedding = embedding

    @property
    def top(self) -> list:
        cdef int t
        if self._top is None and self._labels is not None:
            self._top = [(self._labels[self._best[t]], <double>self._probs[t])
                         for t in range(self._k)]
        return self._top

    @top.setter
    def top(self, value):
        self._top = value
        self._labels = None

    @property
    def embedding(self):
        if self._embedding is None and self._logits is not None:
            self._embedding = unit_array(<const float *><const char *>self._logits,
                                         len(self._logits) // sizeof(float), self._norm)
            self._logits = None
        return self._embedding

    @embedding.setter
    def embedding(self, value):
        self._embedding = value
        self._logits = None

    def as_dict(self) -> dict:
        return {"label": self.label, "confidence": round(self.confidence, 6),
                "domain": self.domain,
                "top": [[lab, round(p, 6)] for lab, p in self.top]}

    def __repr__(self) -> str:
        return (f"Decision(label={self.label!r}, confidence={self.confidence!r}, "
                f"domain={self.domain!r}, top={self.top!r})")


cdef class LinearHead:
    cdef signed char *table  # rows padded to `stride` columns of zeros
    cdef Py_ssize_t stride
    cdef bag_fn bag
    cdef float *scale
    cdef float *acc
    cdef float *exps
    cdef short *sums
    cdef int64_t *ids
    cdef float *weights
    cdef readonly Vectorizer vectorizer  # what fills ids and weights in classify()
    cdef Py_ssize_t cap
    cdef object inputs  # the bound arrays, kept alive
    cdef list labels  # by class, for decide()
    cdef list domains
    cdef str oos_label
    cdef str oos_domain
    cdef readonly int rows
    cdef readonly int classes

    def __cinit__(self):
        self.table = NULL
        self.scale = NULL
        self.acc = NULL
        self.exps = NULL
        self.sums = NULL
        self.ids = NULL
        self.weights = NULL
        self.cap = 0

    def __init__(self, table, scale, *, bint portable=False):
        # portable: the plain C bag even where AVX2 is there (the tests compare the two)
        self.bag = bag_portable if portable else BEST_BAG
        table = np.ascontiguousarray(table, dtype=np.int8)
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        if table.ndim != 2 or scale.ndim != 1 or scale.shape[0] != table.shape[1]:
            raise ValueError(f"table {table.shape} and scale {scale.shape} do not match")
        if table.shape[1] < 1:
            raise ValueError("the table has no classes")
        if self.table != NULL:
            raise TypeError("LinearHead is initialised once")
        cdef Py_ssize_t rows = table.shape[0], C = table.shape[1]
        cdef Py_ssize_t stride = (C + LANES - 1) // LANES * LANES
        self.rows = rows
        self.classes = C
        self.stride = stride
        # the table starts on a cache line; aligned_alloc wants a multiple of 64
        self.table = <signed char *>aligned_alloc(64, (rows * stride + 64) // 64 * 64)
        self.scale = <float *>malloc(stride * sizeof(float))
        self.acc = <float *>malloc(stride * sizeof(float))
        self.exps = <float *>malloc(stride * sizeof(float))
        self.sums = <short *>malloc(stride * sizeof(short))
        if (self.table == NULL or self.scale == NULL or self.acc == NULL
                or self.exps == NULL or self.sums == NULL):
            raise MemoryError()
        memset(self.table, 0, rows * stride)
        padded = np.asarray(<signed char[:rows, :stride]>self.table) if rows else None
        if rows:
            padded[:, :C] = table
        memset(self.scale, 0, stride * sizeof(float))
        cdef const float[::1] sc = scale
        cdef Py_ssize_t c
        for c in range(C):
            self.scale[c] = sc[c]

    def __dealloc__(self):
        free(self.table)
        free(self.scale)
        free(self.acc)
        free(self.exps)
        free(self.sums)

    def bind(self, int64_t[::1] ids not None, float[::1] weights not None,
             Vectorizer vectorizer=None):
        """The input buffers `run` and `decide` read (the caller refills them per
        text), and the vectorizer `classify` fills them with."""
        if ids.shape[0] != weights.shape[0]:
            raise ValueError("ids and weights differ in length")
        self.inputs = (ids.base, weights.base)
        self.ids = &ids[0]
        self.weights = &weights[0]
        self.cap = ids.shape[0]
        self.vectorizer = vectorizer

    def name(self, list labels not None, list domains not None, str oos_label not None,
             str oos_domain not None):
        """The class labels and domains `decide` answers with."""
        if len(labels) != self.classes or len(domains) != self.classes:
            raise ValueError(f"{self.classes} labels and domains wanted")
        self.labels = [str(lab) for lab in labels]
        self.domains = [str(d) for d in domains]
        self.oos_label = oos_label
        self.oos_domain = oos_domain

    def run(self, Py_ssize_t n, int k):
        """(top_p, top_i, embedding) of the first n (id, weight) pairs of the bound
        buffers: two lists of k and a new float32 array of the classes."""
        cdef int best[TOPK_MAX]
        cdef float total
        cdef float norm = self._forward(n, k, best, &total)
        embedding = unit_array(self.acc, self.classes, norm)
        top_i = []
        top_p = []
        for t in range(k):
            top_i.append(best[t])
            top_p.append(self.exps[best[t]] / total)
        return top_p, top_i, embedding

    def classify(self, text, int k, double threshold) -> Decision:
        """The Decision for a text (str or UTF-8 bytes): the bound vectorizer's ids and
        weights, then `decide`, with no Python call or buffer check between them."""
        if self.vectorizer is None:
            raise ValueError("no vectorizer bound")
        cdef Py_ssize_t n = self.vectorizer._ids(text, self.ids, self.cap)
        self.vectorizer._weights(n, self.weights)
        return self.decide(n, k, threshold)

    cpdef Decision decide(self, Py_ssize_t n, int k, double threshold):
        """The Decision for the first n (id, weight) pairs: `run` and the labels (see
        `name`) in one call; below `threshold` the label is the out-of-scope one."""
        cdef float total
        cdef int t
        if self.labels is None:
            raise ValueError("no labels: call name() first")
        cdef Decision d = Decision.__new__(Decision)
        d._norm = self._forward(n, k, d._best, &total)
        d._k = k
        d._labels = self.labels
        for t in range(k):
            d._probs[t] = self.exps[d._best[t]] / total
        d._logits = PyBytes_FromStringAndSize(<char *>self.acc,
                                              self.classes * sizeof(float))
        d.confidence = d._probs[0]
        if d.confidence < threshold:
            d.label = self.oos_label
            d.domain = self.oos_domain
        else:
            d.label = self.labels[d._best[0]]
            d.domain = self.domains[d._best[0]]
        return d

    cdef float _forward(self, Py_ssize_t n, int k, int *best, float *total_out) except -1:
        """Logits of the first n pairs into acc, exp(logit - max) into exps; the top k
        classes into best, the softmax's sum into total_out. Returns the logits' L2
        norm (what the embedding divides by)."""
        cdef Py_ssize_t j, c, t, C = self.classes, rows = self.rows
        cdef float *acc = self.acc
        cdef float m, norm, v, kth
        cdef int64_t i
        if self.ids == NULL:
            raise ValueError("no input buffers bound")
        if n < 0 or n > self.cap:
            raise ValueError(f"n must be in 0..{self.cap}")
        if k < 1 or k > C or k > TOPK_MAX:
            raise ValueError(f"k must be in 1..{min(C, TOPK_MAX)}")
        for j in range(n):
            i = self.ids[j]
            if i < 0 or i >= rows:
                raise IndexError(f"feature id {i} is outside the table (0..{rows - 1})")
        memset(acc, 0, self.stride * sizeof(float))
        self.bag(acc, self.sums, self.table, self.stride, self.ids, self.weights, n)
        norm = sqrtf(scale_norm2(acc, self.scale, self.stride))
        # The top k in one pass, largest first. Strictly greater displaces, so the lower
        # index wins a tie, as in TopK; most classes fail the first comparison.
        for t in range(k):
            best[t] = <int>t
        for t in range(1, k):  # the first k classes, sorted
            c = t
            while c > 0 and acc[best[c]] > acc[best[c - 1]]:
                best[c], best[c - 1] = best[c - 1], best[c]
                c -= 1
        kth = acc[best[k - 1]]
        for c in range(k, C):
            v = acc[c]
            if v > kth:
                t = k - 1
                while t > 0 and v > acc[best[t - 1]]:
                    best[t] = best[t - 1]
                    t -= 1
                best[t] = <int>c
                kth = acc[best[k - 1]]
        m = acc[best[0]]
        total_out[0] = exp_sum(self.exps, acc, m, C)
        return norm
