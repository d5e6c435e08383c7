"""Parameter-server workers: the client to the shards and the exchange the one loop drives (exchange.py)."""

from psgd.worker.client import PSClient, PSError, fetch_weights

__all__ = ["PSClient", "PSError", "fetch_weights"]
