"""What a checkpoint is on disk, as pure functions and types: no thread, no policy.

Its part: the manifest (built in one place, validated in one place, read as untrusted JSON), the layout of a data file
(safetensors-compatible images, 4 KiB-aligned tensors), the lossless encodings and the small JSON codec, the sealed
checksums, and the checkpoint directory's names (``_store``: which manifest a path names, where data files live).

Invariants: every reader of a manifest goes through ``_validate``; nothing here unpickles; a file image computed here is
the same on every rank and every run for the same tensors.
May import: ``io`` and the top's ``errors``. Never a stage (``select``, ``write``, ``tiers``, ``read``).
"""
