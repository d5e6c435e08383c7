"""The token check of a shard's gRPC calls (the data port's is its hello's: psgd.server.gatekeeper)."""

from __future__ import annotations

import hmac

import grpc

from psgd.channel import TOKEN_METADATA_KEY


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the shared token (metadata ``authorization: Bearer TOKEN``)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token: pass --token or set PSGD_TOKEN "
                                                           "to the job's token")

        self._refusals = {
            (False, False): grpc.unary_unary_rpc_method_handler(refuse),
            (False, True): grpc.unary_stream_rpc_method_handler(refuse),
            (True, False): grpc.stream_unary_rpc_method_handler(refuse),
            (True, True): grpc.stream_stream_rpc_method_handler(refuse),
        }

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(handler_call_details)  # health checks stay open, as orchestrators expect
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return continuation(handler_call_details)
                break
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._refusals[(handler.request_streaming, handler.response_streaming)]
