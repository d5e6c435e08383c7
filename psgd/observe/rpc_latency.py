"""Timing every gRPC call a server answers, by method and status code, into a Prometheus histogram.

:class:`LatencyInterceptor` wraps each handler: a unary reply is timed until it
returns, a streaming one until its last message (or until the client leaves,
as ``CANCELLED``).  The status code is the one the handler set (an abort sets
one), else ``OK`` or ``UNKNOWN`` by how the handler ended.
"""

from __future__ import annotations

import time

import grpc
from prometheus_client import Histogram


def _code_name(context: grpc.ServicerContext, default: str) -> str:
    """The status code the handler set (an abort sets one), else ``default``."""
    try:
        code = context.code()
    except Exception:  # a context without code() (older grpcio): fall back to what we saw
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return default


class LatencyInterceptor(grpc.ServerInterceptor):
    """Times each served call into ``histogram.labels(method, code)``; streaming replies until their last message."""

    def __init__(self, histogram: Histogram):
        self.histogram = histogram

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rpartition("/")[2] or "?"
        observe = self.histogram.labels

        def single(behavior):
            def timed(request, context):
                began, code = time.perf_counter(), "UNKNOWN"
                try:
                    reply = behavior(request, context)
                    code = "OK"
                    return reply
                finally:
                    observe(method, _code_name(context, code)).observe(time.perf_counter() - began)

            return timed

        def streaming(behavior):
            def timed(request, context):
                began, code = time.perf_counter(), "UNKNOWN"
                try:
                    yield from behavior(request, context)
                    code = "OK"
                except GeneratorExit:  # the client went away before the last message
                    code = "CANCELLED"
                    raise
                finally:
                    observe(method, _code_name(context, code)).observe(time.perf_counter() - began)

            return timed

        kinds = (
            ("unary_unary", single, grpc.unary_unary_rpc_method_handler),
            ("unary_stream", streaming, grpc.unary_stream_rpc_method_handler),
            ("stream_unary", single, grpc.stream_unary_rpc_method_handler),
            ("stream_stream", streaming, grpc.stream_stream_rpc_method_handler),
        )
        for attr, wrap, make in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(
                    wrap(behavior),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler
