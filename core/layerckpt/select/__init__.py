"""Which layers a save persists, and how: the first stage of a save.

Its part: the tracker (what each layer did since it was persisted, on a fixed sample), the policy (pure: drifts in,
a decision and its reason out), the plan (``Selector``: measure, decide, compose the layer map), the proof that a
tensor is bit-identical to what the store holds, the layer grouping, embedding row blocks, and the cost model that
decides per tensor and sink whether encoding pays.

Invariants: a layer is persisted with its optimizer state at the same step; a plan is a function of the state and
what was committed, never of what is in flight.
May import: ``format``, ``io`` and the top's ``config``, ``errors``, ``_dist``. Neither ``write`` nor ``read``.
"""
