"""From a store back to tensors: the restore's reading side.

Its part: which tier holds the freshest committed composite and a local view of it (``_fetch``), one local read of a
composite (``_reader``: manifest, then the tensors asked for, file by file), coalesced aligned reads straight into
their final memory (``_read``), the decoding of encoded tensors (``_encread``), and the collective gathering of a
composite spread over the nodes' own directories (``_parts``).

Invariants: every byte read is checked against its sealed checksum before it is used; what a store holds is untrusted
input; a read never writes to the store, but for a node that came back empty, whose own files and manifest a
collective read writes back (``_parts``).
May import: every other folder (``tiers``, ``write``, ``select``, ``format``, ``io``) and the top's ``config``,
``errors``, ``_faults``, ``_dist``.
"""
