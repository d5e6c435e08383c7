"""The shard's network side: the gRPC servicer and the shard's server, the data port and its gatekeeper, the hellos
and the token check, what a push is received into, the hand-out of shared memory, the watchdog, and the one request
handler (:mod:`~psgd.server.net.handler`) through which both transports reach the core."""
