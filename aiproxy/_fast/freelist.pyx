"""A free list for the memory of one C class made and dropped per request.

The Exchange (pipeline/exchange.py) is 648 bytes: past pymalloc's 512-byte limit, so
each one was a glibc malloc() and free() (with the GC header, ~260 and ~170 instructions
under callgrind). install() makes the class's tp_alloc take the memory of one dropped
before, and its tp_free keep up to `keep` of them.

This reuses memory only, the way CPython's own free lists (tuples, floats) do: tp_free
runs when the object's reference count reached zero and its tp_dealloc cleared every
field, so nothing can reach it any more. An Exchange that a timer, a callback or a log
record still holds is not freed, and so never reused. tp_alloc hands the memory back
zeroed, with a reference count of 1 and tracked by the GC, as PyType_GenericAlloc does;
the class's tp_new then sets its fields as for any new object. Subclasses (and a type
with a finalizer, whose GC header keeps a flag) keep the usual allocation.
"""

from cpython.object cimport PyObject, PyTypeObject
from libc.string cimport memset

cdef extern from *:
    """
    /* The GC header this relies on (PyGC_Head before the object, its flags kept by
       PyObject_GC_UnTrack) is CPython 3.11-3.13's default build; elsewhere: no free list. */
    #if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
    #define AIPROXY_FREELIST_LAYOUT 1
    #else
    #define AIPROXY_FREELIST_LAYOUT 0
    #endif
    """
    int AIPROXY_FREELIST_LAYOUT

cdef extern from "Python.h":
    ctypedef PyObject *(*allocfunc)(PyTypeObject *, Py_ssize_t)
    ctypedef struct TypeSlots "PyTypeObject":
        Py_ssize_t tp_basicsize
        Py_ssize_t tp_itemsize
        unsigned long tp_flags
        allocfunc tp_alloc
        void (*tp_free)(void *)
        void *tp_finalize
    PyObject *PyObject_Init(PyObject *op, PyTypeObject *tp)
    void PyObject_GC_Track(void *op)
    unsigned long Py_TPFLAGS_HAVE_GC, Py_TPFLAGS_HEAPTYPE
    PyTypeObject *Py_TYPE(PyObject *)

cdef enum:
    MAX_KEEP = 64

cdef TypeSlots *_type = NULL
cdef allocfunc _alloc = NULL
cdef void (*_free)(void *)
cdef void *_kept[MAX_KEEP]
cdef int _count = 0, _keep = 0
cdef unsigned long long _reused = 0


cdef PyObject *_take(PyTypeObject *t, Py_ssize_t n) noexcept:
    global _count, _reused
    cdef PyObject *o
    if <TypeSlots *>t != _type or n != 0 or _count == 0:
        return _alloc(t, n)
    _count -= 1
    o = <PyObject *>_kept[_count]
    memset(o, 0, _type.tp_basicsize)
    PyObject_Init(o, t)  # the type is not a heap type: no reference to it is taken
    PyObject_GC_Track(o)
    _reused += 1
    return o


cdef void _keep_or_free(void *p) noexcept:
    global _count
    if <TypeSlots *>Py_TYPE(<PyObject *>p) == _type and _count < _keep:
        # Untracked by its tp_dealloc already (every Cython GC class untracks first).
        _kept[_count] = p
        _count += 1
        return
    _free(p)


def install(type cls, int keep) -> bool:
    """Give `cls` (a static, GC-tracked C class without items or a finalizer) a free
    list of up to `keep` objects' memory; False (and nothing changed) for any other, or
    on an interpreter whose object layout it was not written for."""
    global _type, _alloc, _free, _keep
    cdef TypeSlots *t = <TypeSlots *>cls
    if not AIPROXY_FREELIST_LAYOUT or _type != NULL or keep <= 0 or keep > MAX_KEEP or t.tp_itemsize != 0 \
            or t.tp_flags & Py_TPFLAGS_HEAPTYPE or not t.tp_flags & Py_TPFLAGS_HAVE_GC \
            or t.tp_finalize != NULL:
        return False
    _alloc = t.tp_alloc
    _free = t.tp_free
    _keep = keep
    _type = t
    t.tp_alloc = _take
    t.tp_free = _keep_or_free
    return True


def stats() -> tuple[int, int]:
    """(objects whose memory waits to be reused, allocations served from it so far)."""
    return _count, _reused
