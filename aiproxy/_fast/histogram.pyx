# Fixed-bucket latency histogram: observe() runs several times per proxied request,
# and bisect over a tuple of Python floats costs ~10x this C loop.

cdef class Histogram:
    """Counts per upper bound (bucket i holds bounds[i-1] < v <= bounds[i], the last one
    everything above the largest bound) and the sum of the observed values."""

    def __init__(self, buckets: tuple) -> None:
        cdef int i
        if not 0 < len(buckets) <= MAX_BUCKETS:
            raise ValueError(f"1 to {MAX_BUCKETS} buckets")
        self.buckets = tuple(buckets)
        self.n = len(buckets)
        for i in range(self.n):
            self.bounds[i] = buckets[i]
            if i and self.bounds[i] <= self.bounds[i - 1]:
                raise ValueError("bucket bounds must increase")
        for i in range(self.n + 1):
            self.counts_[i] = 0
        self.sum = 0.0

    cpdef void observe(self, double value):
        # Same bucket as bisect_left(bounds, value): the first bound >= value.
        cdef int i = 0
        while i < self.n and self.bounds[i] < value:
            i += 1
        self.counts_[i] += 1
        self.sum += value

    @property
    def counts(self) -> list:
        return [self.counts_[i] for i in range(self.n + 1)]

    def cumulative(self) -> list:
        """[(upper bound as text, count of values <= it), ..., ("+Inf", all)]."""
        cdef long long total = 0
        cdef int i
        out = []
        for i in range(self.n):
            total += self.counts_[i]
            out.append((repr(self.buckets[i]), total))
        out.append(("+Inf", total + self.counts_[self.n]))
        return out
