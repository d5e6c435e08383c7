"""Embedding tables as a process holds them: the rows of one table (``held``: made when first needed, admitted,
evicted), where each id's row is (``index``) and the rules that update rows (``rules``).  What a table is belongs
to the model that declares it (``psgd.model.table``); a shard's share of every table is the shard's own
(``psgd.server.state.tables``)."""
