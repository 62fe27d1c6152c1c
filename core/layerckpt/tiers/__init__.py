"""Copies beyond the local directory: the memory tier and a remote (any fsspec URL), after each local commit.

Its part: the tier copier (a composite copied file by file, its manifest last), the stores it copies into
(``_remote``), the memory tier's place (``_memtier``), the bandwidth cap that a tier's uploads share, and the peer
replicas of node-local directories, each node's part held in a partner node's memory (``_replica``).

Invariants: a tier holds only composites already committed locally, manifest after data; a tier's failure never
fails the save that the local directory committed.
May import: ``write``, ``select``, ``format``, ``io`` and the top's ``config``, ``errors``, ``_faults``, ``_registry``,
``_url``, ``_dist``. Never ``read``.
"""
