# Compiled by Cython in pure-Python mode (setup.py): table.py is the source.
cimport cython


cdef class Route:
    cdef public object name, cfg, clusters, total_weight, sticky_header
    cdef public object path, path_prefix, host, methods, headers, header_rules, query
    cdef public object path_regex, grpc_service, grpc_method, intent, intent_domain
    cdef public object timeout, retries, req_add, req_remove, resp_add, resp_remove
    cdef public object prefix_rewrite, model, req_add_lines, resp_add_lines
    cdef public object cluster, direct, redirect
    # Tested for truth per request: typed, that is a size check in C.
    cdef public tuple cum_weights, filters
    cdef public frozenset retry_statuses
    cdef public long long index
    cdef public bint has_rest, has_policy, resp_edit, retry_unavailable


cdef class _Bucket:
    cdef public dict exact, prefixes
    cdef public tuple prefix_list, prefix_groups
    cdef public list other


cdef class RouteTable:
    cdef public tuple routes
    cdef public dict by_host, by_suffix
    cdef public _Bucket any_host
    cdef public bint has_suffix, uses_intent
    cdef public object max_dots

    cpdef match(self, method, path, host, head, query=*, sem=*)


@cython.locals(route=Route, limit=cython.longlong)
cpdef _first(list routes, Route best, method, path, head, query, sem)
@cython.locals(by_prefix=dict, n=Py_ssize_t, length=Py_ssize_t, prefix=bytes, routes=list)
cpdef _scan(_Bucket bucket, Route best, method, bytes path, head, query, sem)
