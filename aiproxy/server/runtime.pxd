# Compiled by Cython in pure-Python mode (setup.py): runtime.py is the source.
from aiproxy.routing.table cimport RouteTable


cdef class Runtime:
    cdef public object config, http, clusters, max_body, min_timeout, semantic
    cdef public dict via_lines, via_fields  # by Head.version: .get() is a C dict lookup
    cdef public bytes via_10, via_11, via_20  # via_lines' values, None when absent
    cdef public object filter_states, decision_cache, unrouted_filters
    cdef public RouteTable table
    cdef public Py_ssize_t max_header_bytes, max_request_line_bytes, max_headers
    cdef public long long keepalive_timeout_ms, max_keepalive_requests
    cdef public bint x_forwarded, server_timing

    cpdef via_line(self, int version)
