# cython: language_level=3
"""Intent vectorizer: text -> hashed feature ids (and a fixed dense vector).

One pass over the UTF-8 bytes in C, no Python object per token:

* words are runs of ASCII letters/digits and non-ASCII bytes, ASCII lower-cased;
  everything else separates words;
* each word gives a unigram, each adjacent pair a bigram (and each run of three a
  trigram, when word_ngrams is 3), and the word
  wrapped in boundary markers ("<word>") gives character n-grams of `char_min` to
  `char_max` characters (counted in code points: continuation bytes never start
  or end an n-gram);
* hashing is a seeded polynomial over 64-bit words: each byte maps through a
  256-entry table of random words derived from the seed (splitmix64), the word
  gets prefix sums Q[i+1] = Q[i] * P + T[byte_i] (one serial chain per word), and
  the hash of bytes [s, e) is Q[e] - Q[s] * P^(e-s): every n-gram hash is then
  independent of the others, so the CPU computes them in parallel. A word is its
  bytes without the markers; a bigram is h(w1) * P + h(w2), a trigram
  (h(w1) * P + h(w2)) * P + h(w3). Each hash is xor'ed with a per-kind tag,
  multiplied by the 64-bit golden ratio and reduced to `[0, buckets)` with
  Lemire's multiply-shift (`(h * buckets) >> 64`), which reads the high bits:
  those depend on every bit of the polynomial. (murmur3's fmix64 here instead
  doubles the cost of a 200-byte prompt, 3.1 vs 1.4 us, for no accuracy.)

With a vocabulary (`set_vocabulary`: the words of a model trained with pretrained
word vectors), each word whose hash is in it also gives the id `buckets + index`,
found with one probe of an open-addressing table keyed by the word hash the scan
has already computed; those ids follow the n-gram ids and are pooled on their own.

`aiproxy.semantic.features.reference_hashes` is the same algorithm in plain
Python; the tests hold the two to each other and to fixed values, so a model
trained today keeps its meaning.

The dense vector (`vector`) puts structured slots (user id, action, location by
default) at fixed dimension ranges and the text n-grams in the rest, each
feature a signed hashed count, then L2-normalises the whole.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.math cimport sqrt
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy, memset

import numpy as np

from time import perf_counter as _perf_counter

cdef extern from *:
    """
    static inline uint64_t aiproxy_fastrange64(uint64_t h, uint64_t n) {
        return (uint64_t)(((unsigned __int128)h * (unsigned __int128)n) >> 64);
    }
    #define AIPROXY_POLY_P 0x100000001b3ULL
    #define AIPROXY_GOLDEN 0x9e3779b97f4a7c15ULL
    #define AIPROXY_TAG_WORD 0x9e3779b97f4a7c15ULL
    #define AIPROXY_TAG_BIGRAM 0xc2b2ae3d27d4eb4fULL
    #define AIPROXY_TAG_CHAR 0x165667b19e3779f9ULL
    #define AIPROXY_TAG_TRIGRAM 0x94d049bb133111ebULL
    #define AIPROXY_TAG_EMPTY 0x27d4eb2f165667c5ULL
    #define AIPROXY_TAG_SLOT 0x85ebca77c2b2ae63ULL
    #define AIPROXY_FMIX_C1 0xff51afd7ed558ccdULL
    #define AIPROXY_FMIX_C2 0xc4ceb9fe1a85ec53ULL
    """
    uint64_t fastrange64 "aiproxy_fastrange64"(uint64_t h, uint64_t n) noexcept nogil
    const uint64_t POLY_P "AIPROXY_POLY_P"
    const uint64_t GOLDEN "AIPROXY_GOLDEN"
    # compile-time constants: a store through a uint64_t pointer cannot alias them
    const uint64_t _TAG_WORD "AIPROXY_TAG_WORD"
    const uint64_t _TAG_BIGRAM "AIPROXY_TAG_BIGRAM"
    const uint64_t _TAG_CHAR "AIPROXY_TAG_CHAR"
    const uint64_t _TAG_TRIGRAM "AIPROXY_TAG_TRIGRAM"
    const uint64_t _TAG_EMPTY "AIPROXY_TAG_EMPTY"
    const uint64_t _TAG_SLOT "AIPROXY_TAG_SLOT"
    const uint64_t FMIX_C1 "AIPROXY_FMIX_C1"
    const uint64_t FMIX_C2 "AIPROXY_FMIX_C2"


cdef enum:
    MAX_WORD = 64            # longer words are cut to their first 64 bytes

cdef uint64_t POW[MAX_WORD + 3]   # P^k

# Per-kind tags xor'ed in before the finaliser (so "ab" the word, "<ab>" the
# n-gram and "ab cd" the bigram never share a hash by construction).
TAG_WORD = 0x9e3779b97f4a7c15
TAG_BIGRAM = 0xc2b2ae3d27d4eb4f
TAG_CHAR = 0x165667b19e3779f9
TAG_TRIGRAM = 0x94d049bb133111eb
TAG_EMPTY = 0x27d4eb2f165667c5
TAG_SLOT = 0x85ebca77c2b2ae63

assert (TAG_WORD, TAG_BIGRAM, TAG_CHAR, TAG_TRIGRAM, TAG_EMPTY, TAG_SLOT) == (
    _TAG_WORD, _TAG_BIGRAM, _TAG_CHAR, _TAG_TRIGRAM, _TAG_EMPTY, _TAG_SLOT)

# Slot layout of the design documents: (name, first dim, width); text n-grams
# take the dims after the last slot.
DEFAULT_SLOTS = (("user_id", 0, 4), ("action", 4, 12), ("location", 16, 16))

cdef unsigned char WORDCHAR[256]
cdef unsigned char LOWER[256]


cdef void _init_tables() noexcept:
    cdef int c
    for c in range(256):
        LOWER[c] = c
        WORDCHAR[c] = 1 if c >= 0x80 else 0
    for c in range(ord("A"), ord("Z") + 1):
        LOWER[c] = c + 32
        WORDCHAR[c] = 1
    for c in range(ord("a"), ord("z") + 1):
        WORDCHAR[c] = 1
    for c in range(ord("0"), ord("9") + 1):
        WORDCHAR[c] = 1


_init_tables()


cdef void _init_pow() noexcept:
    cdef int k
    POW[0] = 1
    for k in range(1, MAX_WORD + 3):
        POW[k] = POW[k - 1] * POLY_P


_init_pow()


cdef inline uint64_t fmix64(uint64_t k) noexcept nogil:
    k ^= k >> 33
    k *= FMIX_C1
    k ^= k >> 33
    k *= FMIX_C2
    k ^= k >> 33
    return k


cdef inline uint64_t _fin(uint64_t x, uint64_t nb) noexcept nogil:
    """Finish a feature hash: raw 64 bits (nb == 0) or its bucket in [0, nb)."""
    x = x * GOLDEN
    return fastrange64(x, nb) if nb else x


def byte_table(unsigned long long seed=0):
    """The seeded byte -> 64-bit word table (splitmix64 of seed + (byte + 1) * golden)."""
    return [fmix64(<uint64_t>seed + (<uint64_t>c + 1) * GOLDEN) for c in range(256)]


def poly_hash(data, unsigned long long seed=0):
    """Seeded polynomial hash of `data` (bytes), before the finaliser."""
    cdef bytes b = bytes(data)
    cdef uint64_t tab[256]
    cdef int c
    for c in range(256):
        tab[c] = fmix64(<uint64_t>seed + (<uint64_t>c + 1) * GOLDEN)
    return _poly(tab, <const unsigned char *>PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))


cdef inline uint64_t _poly(const uint64_t *tab, const unsigned char *p, Py_ssize_t n) noexcept nogil:
    cdef uint64_t h = 0
    cdef Py_ssize_t i
    for i in range(n):
        h = h * POLY_P + tab[p[i]]
    return h


def mix64(unsigned long long k):
    """murmur3 fmix64."""
    return fmix64(k)


cdef inline const unsigned char *_view(object text, Py_ssize_t *n) except NULL:
    """Borrow the UTF-8 bytes of a str or bytes object (no copy)."""
    cdef const char *s
    if type(text) is bytes:
        n[0] = PyBytes_GET_SIZE(text)
        return <const unsigned char *>PyBytes_AS_STRING(text)
    if type(text) is str:
        s = PyUnicode_AsUTF8AndSize(text, n)
        return <const unsigned char *>s
    raise TypeError(f"text must be str or bytes, not {type(text).__name__}")


cdef class Vectorizer:
    """Hashed n-gram features of a text.

    buckets      size of the id space (rows of the model's embedding table)
    seed         hash seed (part of the model: change it and retrain)
    word_ngrams  1 = unigrams, 2 = + bigrams, 3 = + trigrams
    char_min/max character n-gram lengths over "<word>"; char_max=0 turns them off
    max_features cap on features per text (the rest of a long text is ignored)
    pooling      "mean" (weights 1/n) or "sqrt" (1/sqrt(n)) for `encode_into`
    dims, slots  layout of the dense `vector`: slots are (name, start, width)
    """

    def __cinit__(self, *args, **kwargs):
        self.scratch = NULL
        self.vkeys = NULL
        self.vvals = NULL
        self.vbuf = NULL
        self.vocabulary_size = 0

    def __init__(self, long long buckets=1 << 18, unsigned long long seed=0, int word_ngrams=2,
                 int char_min=3, int char_max=5, Py_ssize_t max_features=2048,
                 str pooling="mean", int dims=128, slots=DEFAULT_SLOTS, vocabulary=None):
        cdef int end = 0, c
        if buckets < 1:
            raise ValueError("buckets must be >= 1")
        if word_ngrams not in (1, 2, 3):
            raise ValueError("word_ngrams must be 1, 2 or 3")
        if char_max and not (1 <= char_min <= char_max <= 16):
            raise ValueError("need 1 <= char_min <= char_max <= 16 (or char_max = 0)")
        if max_features < 1:
            raise ValueError("max_features must be >= 1")
        if pooling not in ("mean", "sqrt"):
            raise ValueError("pooling must be 'mean' or 'sqrt'")
        layout = []
        for name, start, width in slots:
            start, width = int(start), int(width)
            if start < 0 or width < 1 or start + width > dims:
                raise ValueError(f"slot {name!r} ({start}, {width}) does not fit in {dims} dims")
            layout.append((str(name), start, width))
            end = max(end, start + width)
        if end >= dims:
            raise ValueError(f"no dims left for text features after the slots ({end} of {dims})")
        self.buckets = buckets
        self.seed = seed
        self.word_ngrams = word_ngrams
        self.char_min = char_min if char_max else 0
        self.char_max = char_max
        self.max_features = max_features
        self.sqrt_pool = pooling == "sqrt"
        self.dims = dims
        self.slots = tuple(layout)
        self.text_start = end
        self.text_end = dims
        self.base = fmix64(seed ^ GOLDEN)
        for c in range(256):
            self.table[c] = fmix64(<uint64_t>seed + (<uint64_t>c + 1) * GOLDEN)
        if self.scratch != NULL:
            PyMem_Free(self.scratch)
        self.scratch = <uint64_t *>PyMem_Malloc(max_features * sizeof(uint64_t))
        if self.vbuf != NULL:
            PyMem_Free(self.vbuf)
        self.vbuf = <int64_t *>PyMem_Malloc(max_features * sizeof(int64_t))
        if self.scratch == NULL or self.vbuf == NULL:
            raise MemoryError()
        self.vcnt = 0
        self.last_ngrams = 0
        if vocabulary is not None:
            self.set_vocabulary(vocabulary)

    def __dealloc__(self):
        if self.scratch != NULL:
            PyMem_Free(self.scratch)
            self.scratch = NULL
        self._free_vocabulary()
        if self.vbuf != NULL:
            PyMem_Free(self.vbuf)
            self.vbuf = NULL

    def _free_vocabulary(self):
        if self.vkeys != NULL:
            PyMem_Free(self.vkeys)
            self.vkeys = NULL
        if self.vvals != NULL:
            PyMem_Free(self.vvals)
            self.vvals = NULL
        self.vocabulary_size = 0

    def set_vocabulary(self, words):
        """Words (str or UTF-8 bytes, each one token as the scan splits text) that get
        their own feature id: word i of the list is id `buckets + i`, emitted after the
        n-gram ids for every occurrence in a text, with its own pooling weight (1/k over
        the k vocabulary words found). The lookup reuses the word hash the scan already
        computes: one probe of an open-addressing table per word. None or [] removes it."""
        cdef Py_ssize_t n, i, L, size = 16
        cdef const unsigned char *p
        cdef unsigned char lw[MAX_WORD]
        cdef uint64_t h, slot
        self._free_vocabulary()
        words = list(words or ())
        if not words:
            return
        if len(words) >= (1 << 30):
            raise ValueError("vocabulary too large")
        while size < 2 * len(words):
            size <<= 1
        keys = <uint64_t *>PyMem_Malloc(size * sizeof(uint64_t))
        vals = <int32_t *>PyMem_Malloc(size * sizeof(int32_t))
        if keys == NULL or vals == NULL:
            PyMem_Free(keys)
            PyMem_Free(vals)
            raise MemoryError()
        memset(keys, 0, size * sizeof(uint64_t))
        self.vkeys, self.vvals, self.vmask = keys, vals, size - 1
        try:
            for idx, word in enumerate(words):
                p = _view(word, &n)
                if n == 0 or n > MAX_WORD:
                    raise ValueError(f"vocabulary word {word!r}: empty or longer than {MAX_WORD} bytes")
                for i in range(n):
                    if not WORDCHAR[p[i]]:
                        raise ValueError(f"vocabulary word {word!r} is not one token")
                    lw[i] = LOWER[p[i]]
                h = _poly(self.table, lw, n)
                if h == 0:  # the empty-slot key; a word hashing to 0 is never looked up
                    continue
                slot = ((h * GOLDEN) >> 32) & self.vmask
                while keys[slot] != 0:
                    if keys[slot] == h:
                        raise ValueError(f"vocabulary word {word!r} is there twice")
                    slot = (slot + 1) & self.vmask
                keys[slot] = h
                vals[slot] = <int32_t>idx
            self.vocabulary_size = len(words)
        except BaseException:
            self._free_vocabulary()
            raise

    @property
    def pooling(self):
        return "sqrt" if self.sqrt_pool else "mean"

    def settings(self):
        """The settings a model needs to reproduce these features (stored in its metadata)."""
        return {
            "hash": "poly64+golden+fastrange",
            "seed": int(self.seed),
            "buckets": int(self.buckets),
            "word_ngrams": self.word_ngrams,
            "char_ngrams": [self.char_min, self.char_max],
            "max_features": int(self.max_features),
            "pooling": self.pooling,
            "lowercase": "ascii",
            "dims": self.dims,
            "slots": [list(s) for s in self.slots],
        } | ({"vocabulary_size": int(self.vocabulary_size)} if self.vocabulary_size else {})

    cdef Py_ssize_t _scan(self, const unsigned char *p, Py_ssize_t n,
                          uint64_t *out, Py_ssize_t cap, uint64_t nb) noexcept nogil:
        """Feature hashes of p[0:n] into out, as buckets in [0, nb) or raw 64-bit values
        (nb == 0); returns how many (>= 1)."""
        cdef Py_ssize_t i = 0, ws, L, k, s, j, m, e, cnt = 0
        cdef uint64_t hw, prev = 0, prev2 = 0
        cdef int have_prev = 0
        cdef bint ascii
        cdef bint trigrams = self.word_ngrams >= 3
        cdef unsigned char c, hi
        cdef int nc
        cdef int cmin = self.char_min, cmax = self.char_max
        cdef bint bigrams = self.word_ngrams >= 2
        cdef const uint64_t *tab = self.table
        cdef unsigned char buf[MAX_WORD + 2]
        cdef uint64_t Q[MAX_WORD + 3]
        cdef uint64_t pw[MAX_WORD + 3]  # local copy of P^k: out[] stores cannot alias it
        cdef uint64_t qs, slot, vk
        cdef bint vocab = self.vocabulary_size > 0 and nb != 0
        cdef const uint64_t *vkeys = self.vkeys
        cdef uint64_t vmask = self.vmask
        cdef Py_ssize_t vcnt = 0
        memcpy(pw, POW, sizeof(pw))
        while cnt < cap:
            while i < n and not WORDCHAR[p[i]]:
                i += 1
            if i >= n:
                break
            ws = i
            while i < n and WORDCHAR[p[i]]:
                i += 1
            L = i - ws
            if L > MAX_WORD:
                L = MAX_WORD
            m = L + 2
            buf[0] = 60  # '<'
            Q[0] = 0
            Q[1] = tab[60]
            hi = 0
            for k in range(L):
                c = LOWER[p[ws + k]]
                hi |= c
                buf[k + 1] = c
                Q[k + 2] = Q[k + 1] * POLY_P + tab[c]
            buf[L + 1] = 62  # '>'
            Q[L + 2] = Q[L + 1] * POLY_P + tab[62]
            ascii = hi < 0x80
            hw = Q[L + 1] - Q[1] * pw[L]
            out[cnt] = _fin(hw ^ _TAG_WORD, nb)
            cnt += 1
            if vocab and vcnt < cap:
                slot = ((hw * GOLDEN) >> 32) & vmask
                vk = vkeys[slot]
                while vk != 0:
                    if vk == hw:
                        self.vbuf[vcnt] = <int64_t>nb + self.vvals[slot]
                        vcnt += 1
                        break
                    slot = (slot + 1) & vmask
                    vk = vkeys[slot]
            if bigrams and have_prev and cnt < cap:
                out[cnt] = _fin((prev * POLY_P + hw) ^ _TAG_BIGRAM, nb)
                cnt += 1
                if trigrams and have_prev > 1 and cnt < cap:
                    out[cnt] = _fin(((prev2 * POLY_P + prev) * POLY_P + hw) ^ _TAG_TRIGRAM, nb)
                    cnt += 1
            prev2 = prev
            prev = hw
            have_prev += 1
            if not cmax:
                continue
            if ascii and cnt + m * (cmax - cmin + 1) <= cap:
                # ASCII word with room for all its n-grams: no checks in the loop
                for s in range(m - cmin + 1):
                    e = s + cmax
                    if e > m:
                        e = m
                    qs = Q[s]
                    for j in range(s + cmin, e + 1):
                        out[cnt] = _fin((Q[j] - qs * pw[j - s]) ^ _TAG_CHAR, nb)
                        cnt += 1
                continue
            for s in range(m):
                if (buf[s] & 0xC0) == 0x80:
                    continue
                nc = 0
                for j in range(s + 1, m + 1):
                    if j < m and (buf[j] & 0xC0) == 0x80:
                        continue
                    nc += 1
                    if nc >= cmin:
                        if cnt >= cap:
                            self.vcnt = vcnt
                            return cnt
                        out[cnt] = _fin((Q[j] - Q[s] * pw[j - s]) ^ _TAG_CHAR, nb)
                        cnt += 1
                        if nc >= cmax:
                            break
        if cnt == 0:
            out[0] = _fin(self.base ^ _TAG_EMPTY, nb)
            cnt = 1
        self.vcnt = vcnt
        return cnt

    cdef Py_ssize_t _ids(self, object text, int64_t *out, Py_ssize_t cap) except -1:
        """N-gram ids, then (with a vocabulary) the vocabulary ids of the text's words,
        as many as fit: the n-grams take at most 15/16 of `cap` then."""
        cdef Py_ssize_t n, cnt, k
        cdef const unsigned char *p = _view(text, &n)
        if cap > self.max_features:
            cap = self.max_features
        if cap < 1:
            raise ValueError("output buffer is empty")
        if not self.vocabulary_size or cap < 16:
            # ids < buckets < 2**63: the uint64 buckets are the int64 ids
            cnt = self._scan(p, n, <uint64_t *>out, cap, <uint64_t>self.buckets)
            self.last_ngrams = cnt
            return cnt
        cnt = self._scan(p, n, <uint64_t *>out, cap - cap // 16, <uint64_t>self.buckets)
        self.last_ngrams = cnt
        k = self.vcnt
        if k > cap - cnt:
            k = cap - cnt
        if k > 0:
            memcpy(out + cnt, self.vbuf, k * sizeof(int64_t))
            cnt += k
        return cnt

    cdef void _weights(self, Py_ssize_t cnt, float *w) noexcept:
        """Pooling weights of the last _ids output: each part (n-grams, vocabulary words)
        pooled on its own, 1/n or 1/sqrt(n) over that part."""
        cdef Py_ssize_t i, a = self.last_ngrams, b = cnt - self.last_ngrams
        cdef float wa, wb = 0
        wa = <float>(1.0 / sqrt(<double>a)) if self.sqrt_pool else <float>(1.0 / a)
        if b > 0:
            wb = <float>(1.0 / sqrt(<double>b)) if self.sqrt_pool else <float>(1.0 / b)
        for i in range(a):
            w[i] = wa
        for i in range(a, cnt):
            w[i] = wb

    def ids(self, text):
        """Feature ids of `text` (str or UTF-8 bytes) as a new int64 array."""
        cdef Py_ssize_t n
        cdef int64_t[::1] view
        arr = np.empty(self.max_features, dtype=np.int64)
        view = arr
        n = self._ids(text, &view[0], view.shape[0])
        return arr[:n].copy()

    def time_ids(self, text, Py_ssize_t repeat=10000):
        """Seconds per feature-id extraction of `text`, timed over `repeat` calls made
        from C (the bench suite's number without the Python call around it)."""
        cdef Py_ssize_t i
        cdef int64_t *buf = <int64_t *>PyMem_Malloc(self.max_features * sizeof(int64_t))
        if buf == NULL:
            raise MemoryError()
        try:
            t0 = _perf_counter()
            for i in range(repeat):
                self._ids(text, buf, self.max_features)
            return (_perf_counter() - t0) / repeat
        finally:
            PyMem_Free(buf)

    def ids_into(self, text, int64_t[::1] out):
        """Write the feature ids of `text` into `out`; returns how many (>= 1)."""
        return self._ids(text, &out[0], out.shape[0])

    def hashes(self, text):
        """Raw 64-bit feature hashes (before the bucket reduction) as uint64."""
        cdef Py_ssize_t n, cnt
        cdef const unsigned char *p = _view(text, &n)
        cnt = self._scan(p, n, self.scratch, self.max_features, 0)
        arr = np.empty(cnt, dtype=np.uint64)
        cdef uint64_t[::1] v = arr
        for i in range(cnt):
            v[i] = self.scratch[i]
        return arr

    cpdef Py_ssize_t encode_into(self, object text, int64_t[::1] ids, float[::1] weights) except -1:
        """Ids into `ids` and pooling weights (1/n or 1/sqrt(n)) into `weights`."""
        cdef Py_ssize_t cap = ids.shape[0], cnt
        if weights.shape[0] < cap:
            cap = weights.shape[0]
        cnt = self._ids(text, &ids[0], cap)
        self._weights(cnt, &weights[0])
        return cnt

    def encode_batch(self, texts, int64_t[:, ::1] ids, float[:, ::1] weights):
        """Encode each text into a row of `ids`/`weights` (rows padded with id 0 and
        weight 0 up to the longest); returns the longest row length."""
        cdef Py_ssize_t b = 0, cnt, longest = 0, i, width = ids.shape[1]
        cdef int64_t *row
        if weights.shape[1] < width:
            width = weights.shape[1]
        for text in texts:
            if b >= ids.shape[0] or b >= weights.shape[0]:
                raise ValueError("more texts than rows")
            row = &ids[b, 0]
            cnt = self._ids(text, row, width)
            self._weights(cnt, &weights[b, 0])
            for i in range(cnt, width):
                row[i] = 0
                weights[b, i] = 0
            if cnt > longest:
                longest = cnt
            b += 1
        return longest

    def vector(self, text, slots=None, out=None):
        """Dense float32 vector (`dims`): signed hashed slots at their dims, text
        n-grams in the rest, L2-normalised. `slots` maps slot name -> value (str,
        bytes, int or a list of them); unknown names are ignored."""
        cdef float[::1] v
        cdef Py_ssize_t n, cnt, i
        cdef const unsigned char *p
        cdef uint64_t h
        cdef uint64_t tw = self.text_end - self.text_start
        cdef double norm = 0.0
        cdef float inv
        if out is None:
            out = np.zeros(self.dims, dtype=np.float32)
        v = out
        if v.shape[0] != self.dims:
            raise ValueError(f"out must have {self.dims} elements")
        memset(&v[0], 0, self.dims * sizeof(float))
        if slots:
            for name, start, width in self.slots:
                value = slots.get(name)
                if value is None:
                    continue
                for item in (value if isinstance(value, (list, tuple)) else (value,)):
                    h = self._slot_hash(name, item)
                    i = start + <Py_ssize_t>fastrange64(h, <uint64_t>width)
                    v[i] += -1.0 if (h & 1) else 1.0
        if text is not None:
            p = _view(text, &n)
            cnt = self._scan(p, n, self.scratch, self.max_features, 0)
            for i in range(cnt):
                h = self.scratch[i]
                v[self.text_start + <Py_ssize_t>fastrange64(h, tw)] += -1.0 if (h & 1) else 1.0
        for i in range(self.dims):
            norm += v[i] * v[i]
        if norm > 0:
            inv = <float>(1.0 / sqrt(norm))
            for i in range(self.dims):
                v[i] *= inv
        return out

    cdef uint64_t _slot_hash(self, str name, object value) except? 0:
        cdef bytes key
        if isinstance(value, bytes):
            key = name.encode() + b"=" + value
        else:
            key = (name + "=" + str(value)).encode()
        return fmix64(_poly(self.table, <const unsigned char *>PyBytes_AS_STRING(key),
                            PyBytes_GET_SIZE(key)) ^ _TAG_SLOT)
