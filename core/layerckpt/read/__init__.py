"""From a store back to tensors: the restore's reading side.

Its part: which tier holds the freshest committed composite and a local view of it (``_fetch``), one local read of a
composite (``_reader``: manifest, then the tensors asked for, file by file), coalesced aligned reads straight into
their final memory (``_read``), and the decoding of encoded tensors (``_encread``).

Invariants: every byte read is checked against its sealed checksum before it is used; what a store holds is untrusted
input; a read never writes to the store.
May import: every other folder (``tiers``, ``write``, ``select``, ``format``, ``io``) and the top's ``config``,
``errors``, ``_faults``.
"""
