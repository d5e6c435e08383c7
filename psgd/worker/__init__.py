"""Parameter-server workers: the client to every shard (client.py: one link each, retries, leases) and
the exchange the one loop drives (exchange.py).  How bytes travel is a link's business (psgd.link)."""

from psgd.worker.client import PSClient, PSError, fetch_weights

__all__ = ["PSClient", "PSError", "fetch_weights"]
