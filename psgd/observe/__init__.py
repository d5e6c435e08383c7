"""What a running job tells its user: log lines that say which process and step (``logs``), progress, metrics
lines, CSV rows and TensorBoard events (``progress``), a Prometheus endpoint (``prometheus``) and the latency of
each gRPC call (``rpc_latency``)."""
