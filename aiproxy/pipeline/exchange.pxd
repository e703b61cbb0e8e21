# Compiled by Cython in pure-Python mode (setup.py): exchange.py is the source and this
# file gives the class C-level fields, so `self.x` inside its methods is a struct access.
cimport cython

from aiproxy._fast.clock cimport event_now, monotonic
from aiproxy._fast.h1 cimport RequestHead, ResponseHead, find_query
from aiproxy.pipeline.ends cimport Downstream, ExchangeBase, Upstream
from aiproxy.routing.cluster cimport Cluster
from aiproxy.routing.pool cimport EndpointPool
from aiproxy.routing.table cimport Route
from aiproxy.server.runtime cimport Runtime

# The module's constants, as C values (exchange.py assigns them).
cdef unsigned int F_HOP, F_CONTENT_LENGTH, F_HOST, F_XFF, F_XFP, F_OWN
cdef int P_UPSTREAM, P_PENDING, REQ_NONE, REQ_LENGTH, REQ_CHUNKED, REQ_STREAM
cdef int INSPECT_SEMANTIC, INSPECT_FILTERS
cdef int BODY_NONE, BODY_LENGTH, BODY_TUNNEL  # ends.py's
cdef long long PENDING_LIMIT, REPLAY_LIMIT
cdef Py_ssize_t TOKEN_TAIL
cdef bytes CRLF
cdef tuple NO_INTENT
cdef frozenset RARE_METHODS
cdef double INFINITY

# Not final: Cython refuses a final class overriding its base's cpdef methods.
cdef class Exchange(ExchangeBase):
    # down, method and up_chunked are ExchangeBase's (ends.pxd).
    cdef public object loop, connect_task
    cdef public RequestHead head  # HTTP/2 requests too: fields_request_head in h1.pyx
    cdef public Upstream upstream
    cdef public Runtime rt
    cdef public Route route
    cdef public EndpointPool pool
    cdef public Cluster cluster
    cdef public bint reading_body, req_done
    cdef public int req_mode
    cdef public long long req_remaining, req_bytes, pending_size, replay_size, resp_bytes
    cdef public long long inspect_limit, body_len
    cdef public long long body_cap  # a filter's bound on a body of unknown length; 0: none
    cdef public object body_cap_why
    cdef public object decoder, pending, replay, tried, reused
    cdef public bint pending_end
    cdef public object path, up_target
    cdef public bytes host_line
    cdef public bint head_sent, finished, keep_alive, tunnel, tunnel_up_eof, grpc
    cdef public int status, inspecting, attempts, grpc_status, resp_version
    cdef public double activity, body_activity, req_done_at, t_start, deadline_at
    cdef public double t_parsed, t_routed, t_connect, t_connected, t_sent, t_first
    cdef public double t_start_pc, t_classify, intent_conf, req_timeout
    cdef public bint reported, client_lost, counted, pending_conn, is_retry, replayed
    cdef public bint continued, drained
    cdef public bint close_after  # HTTP/1.1: the connection ends with this response
    cdef public object intent, intent_domain, retry_handle, tok_tail, hold
    cdef public tuple filters  # tested for truth per request: a size check in C
    cdef public object up_headers, gate_task, trace_id, identity, llm
    cdef public object done_filters, splice, intent_decision, _gov
    # The 1xx budget spent (on_upstream_informational) as of info_at
    cdef public double info_used, info_at
    cdef public object upstream_error, no_intent, stream_error, tunnel_ended
    cdef public object tracer  # the tracing filter (governance/tracing.py), None when off

    # The per-request path: C calls between them (no attribute lookup per call).
    cpdef setup(self, down, RequestHead head, double now)
    @cython.locals(head=RequestHead, rare=cython.bint)
    cpdef start(self)
    cpdef _send_continue(self)
    @cython.locals(head=RequestHead, route=Route)
    cpdef _route(self)
    cdef Route _match(self, tuple intent)
    cpdef _dispatch(self)
    cpdef _inspect(self, int kind, long long limit)
    cpdef _inspected(self)
    @cython.locals(head=RequestHead)
    cpdef _classify(self, body)
    cpdef _decided(self, decision, double t0)
    @cython.locals(head=RequestHead)
    cpdef _framing(self)
    cpdef feed_body(self, data)
    @cython.locals(up=Upstream)
    cpdef _forward(self, parts)
    @cython.locals(up=Upstream)
    cpdef _request_complete(self)
    @cython.locals(up=Upstream)
    cpdef _use(self, EndpointPool pool)
    cpdef _new_connection(self, pool)
    cpdef _unpend(self)
    cpdef _attach(self, Upstream up, reused)
    cpdef check_deadline(self, now, body_timeout)
    @cython.locals(up=Upstream, status=cython.int, version=cython.int, route=Route,
                   r=ResponseHead)
    cpdef on_upstream_head(self, resp, int mode)
    cpdef on_upstream_body(self, data)
    @cython.locals(up=Upstream)
    cpdef on_upstream_end(self, trailers=*)
    cpdef flush(self)
    @cython.locals(up=Upstream)
    cpdef _drop_upstream(self)
    cpdef _finish(self, keep_alive)
    cpdef timings(self)
    @cython.locals(rt=Runtime, head=RequestHead, drop=cython.uint, extra=tuple, ep=EndpointPool)
    cpdef h1_request_head(self, pool)
    cpdef _report(self)
    cpdef _release_cluster(self)
