"""From a plan to a committed checkpoint: gather, stage, flush, commit, retain.

Its part: gather the (key, tensor) pairs a save holds, copy them into pooled aligned host buffers (``_stage``), write
them on one background thread through the backend (``_writeloop``, ``_encwrite`` for encoded tensors), fsync, and
commit (``_commit``: fold the ranks' files into the manifest, written atomically: the one commit point). Retention
drops what no kept composite uses. ``_torchfile`` writes plain ``torch.save`` files through the same path;
``_transcode`` rewrites a data file as a slower tier wants it.

Invariants: a committed checkpoint is never written again; nothing is visible before its manifest is durable; a
failure before the commit point leaves the previous checkpoint as the newest.
May import: ``select``, ``format``, ``io`` and the top's ``config``, ``errors``, ``_dist``, ``_faults``, ``_registry``.
Neither ``tiers`` nor ``read``.
"""
