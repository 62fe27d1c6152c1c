"""The one Config of layerckpt: a validated dataclass, loadable from YAML.

Its fields govern four things (``GROUPS``): which layers a save writes (selection), how saves and restores
move bytes (I/O), where copies go and how many stay (tiers), and what a restore checks and puts back
(restore).  A combination whose fields contradict each other is refused with a ConfigError naming the field
to drop; where one field changes what another means, both docstrings say so.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .io._units import ALIGN, GiB, KiB, MiB, parse_size  # noqa: F401 - their home is _units; importable here too
from ._url import check_config
from .errors import ConfigError

ENCODINGS = ("auto", "delta", "compress", "off", "lossy")  # Config.encoding's choices
REMOTE_BASES = "base"  # Config.remote_every: base composites only
FIDELITY = 0.004  # Config.fidelity's default


class _Default(float):
    """Config.fidelity's default value: a plain float to whoever reads it, but one the caller did not give,
    so that it never contradicts a ``threshold`` or ``full`` that was given."""

    __slots__ = ()


_FIDELITY = _Default(FIDELITY)


@dataclass
class Config:
    """What to persist, when, and how to write it.

    ``Config(full=True)`` (or its other spelling ``Config(threshold=0.0)``) persists every layer at every
    save: a full checkpoint.  Flat keyword arguments, ``from_yaml`` and ``from_dict`` all build the same
    validated object; ``GROUPS`` lists the fields by what they govern.
    """

    fidelity: float = _FIDELITY
    """The default selection rule's one knob, with no scale of its own: layers are skipped, cheapest first,
    while a restore of the composite is estimated (first order, from the optimizer's gradient averages) to
    raise the training loss by at most this fraction of it.  Needs the loss: ``save(step, loss=...)``,
    which the Lightning and Accelerate adapters pass; without it a conservative stand-in applies.
    0.0 writes every layer that moved.  ``threshold`` and ``full`` are the other rules: an explicit fidelity
    beside either is refused (give one rule).  ``budget_bytes`` caps what this rule picks."""
    threshold: Optional[float] = None
    """Instead of the fidelity rule: persist a layer once its relative drift ||W - W_p|| / ||W_p|| reaches
    this.  Refused beside an explicit ``fidelity``.  0.0 without ``budget_bytes`` is the other spelling of
    ``full=True`` (the two give equal Configs); 0.0 with ``budget_bytes`` is not full: every layer that
    moved, most drifted first, up to the cap.  ``Config.replace(threshold=...)`` on a full Config leaves the
    full mode unless the new threshold is 0.0."""
    max_staleness: int = 16
    """A layer that moves may lag at most this many checkpoints; at the bound it is persisted regardless.
    Also restore's bound: ``restore()`` checks a composite against the Config it is passed, else against the
    default, never against the one recorded in its manifest.  Nothing lags in full mode."""
    base_every: int = 0
    """Write a base composite every N checkpoints: every layer, every tensor self-contained (no delta against
    an older file); 0 never forces one after the first.  With ``remote_every="base"`` it decides which
    composites reach the remote tier (so there 0 is refused unless every save is full)."""
    keep_last: int = 2
    """Composites kept restorable, locally and on the remote tier (besides ``Checkpointer.keep()``'s pins and
    the composites a tier is still copying); older manifests (and data no kept manifest needs) are deleted,
    but for up to two data files kept for later saves to write over (``spares/spare-<n>``: a write over a
    written file is faster than into a new one; a full-save store holds one such file at rest, the size of a
    save).  0 keeps all.  The memory tier keeps 1 whatever this says.  The Lightning callback makes it 1 with a
    ``monitor`` (0 with ``save_top_k=-1``) when neither a config nor keep_last is given; under the Accelerate
    plugin accelerate's ``total_limit`` decides which folders stay and the composites follow the folders:
    keep_last does not apply there."""
    staging_bytes: int = 4 * GiB
    """Bound on pooled host staging memory; a save needing more waits for the flusher (back-pressure).
    At least ``chunk_bytes``."""
    chunk_bytes: int = 16 * MiB
    """Size of one staging buffer and of one write; small tensors are coalesced into it.  It also sizes what
    else moves in pieces: restore reads through ``min(4, queue_depth)`` bounce buffers of this size, and the
    remote tier uploads a file in parts of ``max(chunk_bytes, 5 MiB)`` (S3's least).  A multiple of 4096,
    at most 1GiB and at most ``staging_bytes``."""
    queue_depth: int = 8
    """Writes in flight at once on save; reads in flight on restore and in the CLI's ``verify``."""
    max_inflight: int = 1
    """Saves in flight at once; the next save() waits while this many are flushing.  Full saves, and selective
    saves in one process, pipeline: each selective one plans on the one before it.  Across ranks a selective
    save waits for every save before it whatever this says (the ranks agree on the last committed one)."""
    lazy_staging: bool = True
    """With an optimizer: save() returns once it has decided what to write (the buffers, RNG and extra
    copied); the parameters and optimizer state are copied in the background while training goes on, and
    ``optimizer.step()`` waits for those copies (after its closure, if it has one).  Needs the weights to
    change only through that optimizer's step until the copies are done: a save whose tensors changed
    otherwise meanwhile fails (nothing committed).  False (or no optimizer) copies everything before save()
    returns."""
    backend: str = "auto"
    """'auto' (io_uring, else threads), 'uring' or 'threads', for saves and restores; LAYERCKPT_BACKEND
    overrides."""
    direct_io: bool = True
    """Write and read with O_DIRECT (bypassing the page cache) where the file system allows it."""
    verify_checksums: bool = True
    """Check every tensor's CRC32C on restore."""
    restore_rng: bool = True
    """Restore the python/numpy/torch RNG states saved with the checkpoint.  The Accelerate plugin turns it
    off for its loads: accelerate restores RNG from its own files."""
    sign_key: Optional[str] = field(default=None, repr=False)
    """A secret (at least 16 characters) that signs every checkpoint this Config saves and that a restore with it
    requires (docs/failure-semantics.md, "Signed checkpoints"): each data file's SHA-256 digest is taken as it is
    written, each manifest carries an HMAC-SHA256 over itself (every entry, seal and digest) and the store's
    identity; a restore or ``verify`` with the key refuses a checkpoint not signed by it, one copied from another
    store, and a data file whose bytes differ from its digest.  None: the environment's ``LAYERCKPT_SIGN_KEY``,
    else unsigned.  Never written to the store, never shown (repr, ``recorded``).  Remote copies are the local
    files byte for byte (no encoded copy: its bytes would need a digest of their own)."""
    budget_bytes: Optional[int] = None
    """Optional cap on the bytes one checkpoint writes: drifted layers go most-drifted first; forced ones
    always.  Applies to the fidelity and threshold rules; refused with ``full=True`` (a capped save is not
    full)."""
    drift_sample: int = 16384
    """Elements per layer sampled to estimate drift (0: every element; exact, but keeps a copy of the weights).
    Unused in full mode: nothing is decided by drift."""
    row_block_bytes: int = 1 * MiB
    """Embedding tables (``nn.Embedding``/``nn.EmbeddingBag`` weights, tied heads too) at least twice this big
    are selected in blocks of this many bytes of rows, each block with the same rows of its optimizer state,
    so a checkpoint writes only the blocks that moved; 0 keeps every table whole, as full mode always does."""
    layers: Optional[Dict[str, str]] = None
    """Glob patterns of state_dict names -> layer name, overriding the automatic grouping (first match wins):
    the unit every selection rule decides on."""
    memory_tier: bool = False
    """Also keep the newest composite in shared memory (/dev/shm/layerckpt-<hash of the directory>/, same
    format), one only whatever ``keep_last`` says: after a process crash a restore whose ``config=`` has
    ``memory_tier=True`` reads it from there (without one, the disk is read); after a node restart it is gone
    and the disk is read.  False also removes a memory tier an earlier run of the directory left, when the
    directory's writer opens it (it would shadow this run's saves)."""
    remote: Optional[str] = None
    """An fsspec URL ('s3://bucket/prefix', 'gs://...', 'file:///mnt/nfs/run1', 'memory://run1') the committed
    composites are copied to in the background, data first and the manifest last (the remote commit point).
    ``restore()``/``read_checkpoint()`` of the local directory read this remote only when the ``config=``
    given to them names it (then the freshest of the directory, its memory tier where that Config enables
    it, and this remote is read); without a Config they read the local directory alone, and never the remote
    a manifest recorded (a manifest is data: its Config redirects nothing).  The remote is also read when its
    URL is given as the path (``restore(URL, ..., config=...)``; the CLI with ``--remote-options``), its
    options then taken from the ``config=`` given, if any.  ``remote_options``, ``remote_every`` and
    ``remote_bandwidth`` are refused without it.  Needs ``pip install 'layerckpt[remote]'`` (fsspec, s3fs)."""
    remote_options: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the fsspec file system (key/secret, client_kwargs={'endpoint_url': ...}, ...);
    never written into a manifest.  Refused without ``remote``."""
    remote_every: Union[int, str] = 1
    """Copy every N-th composite to the remote tier (the first, then each N-th); a failed copy is retried with
    the next composite.  ``"base"``: base composites only, those that read no older file (the first, every
    ``base_every``-th, and in full mode each save whose tensors are written self-contained, see ``delta_chain``),
    so the remote holds only composites that restore from their own files: refused with ``base_every=0``
    unless in full mode.  Refused without ``remote``."""
    remote_bandwidth: Optional[int] = None
    """Cap on the remote tier's upload speed, bytes per second over all its uploads at once ('200MB', '1GiB/s',
    or a number); None: as fast as the network goes.  Uploads take longer; training is not slowed.  Refused
    without ``remote``."""
    encoding: str = "auto"
    """How a data file holds what a save writes, losslessly (restores are bit for bit either way).  'auto'
    (the default) encodes a kind of tensor (dtype, role, frozen, row block) only where the disk time its
    saved bytes would take exceeds the CPU time encoding it costs the training (measured as saves go: the
    encoder's rate and ratio per kind, the disk's rate, and how much of the machine's cores the training
    uses; see ``layerckpt inspect`` for each kind's decision and why): dense fp32 state on a fast disk is
    written raw, what barely changed or a slow disk gets encoded.  The others force one way: 'delta' encodes
    each tensor against a version of it the store already holds (the difference of the bit patterns, split
    into byte planes, zstd-compressed; raw where that does not pay), keeping a host copy of each reference
    (as much host memory as the state the references cover); 'compress' compresses each tensor on its own
    (byte planes + zstd, no reference kept); 'off' writes raw bytes.  The remote tier gets what the disk
    got.  'lossy' (opt-in; restores are then not bit for bit) is 'delta' with bounded loss on fp32 training
    state of 512 bytes and more: a weight with a reference is stored as its difference from it rounded to a
    quantum of ``lossy_quantum`` times the RMS by which one training step moved it (since the reference, or
    lately where that is more; each element within half a quantum; the reference, a self-contained version,
    stays lossless, so errors never add up along the versions), Adam's ``exp_avg`` and SGD's momentum as
    block-wise ``lossy_bits``-bit codes, ``exp_avg_sq`` as block-wise codes of its logarithm (a relative error
    bound); everything else, and whatever a code does not fit (NaN, inf), as 'delta'.  Each tensor's error is
    recorded in the manifest (``layerckpt inspect``, and the restore report's ``quantization``)."""
    delta_chain: int = 8
    """Where tensors are delta-encoded (``encoding='delta'``, or 'auto' where a delta pays): a tensor is
    encoded against its reference for at most this many versions, then written self-contained again (a new
    reference).  A delta always refers to a self-contained version directly (never to another delta), so a
    restore reads at most two versions of a tensor.  Under ``encoding='lossy'`` a weight's bounded-loss deltas
    go on 8 times longer (its error does not grow with the distance from the reference)."""
    encode_threads: int = 0
    """Threads that encode (and decode on restore); 0: half the machine's cores, at least one, so training
    keeps the rest."""
    # last, so that every other field keeps its place for positional arguments
    full: bool = False
    """Full mode: every layer at every save, so no save carries a layer from the one before, but for a frozen
    layer (every parameter ``requires_grad=False``) proven bit-identical, on every byte, to the version the
    composite holds: that one writes nothing in any encoding (in one process, and not with
    ``remote_every='base'``, whose remote copies must read no older file; the first save and a due
    ``base_every`` write it too).  Under ``encoding='delta'`` its tensors are still encoded against their
    references: a base composite, one that reads no older file, every ``delta_chain + 1`` saves, or every
    ``base_every``-th.
    Besides deciding nothing by drift, it turns off what only selective saves need: drift sampling, row blocks
    of embedding tables, the exchange of the loss across ranks and the manifest's cost estimates; saves
    pipeline across ranks up to ``max_inflight``; ``base_every`` and ``max_staleness`` have nothing left to
    force.  Refused beside an explicit ``fidelity``, a ``threshold`` other than 0.0 or a ``budget_bytes``.
    ``threshold=0.0`` (without budget_bytes) is the same mode: both spellings give an equal Config, with
    ``full=True`` and ``threshold=0.0``.  ``Config.replace(full=False)`` returns to the fidelity rule."""
    # added after ``full``, to keep the fields' places
    lossy_quantum: float = 2.0
    """``encoding='lossy'``: a weight delta's quantum, in units of the RMS by which one training step moved the
    tensor (on average since its reference, or over the last interval between saves where that is more, as
    the tracker's sample measures it; full mode samples nothing): each element is restored within half of it
    (2.0: within one step's move).
    Larger writes fewer bytes and restores further from the saved state."""
    lossy_bits: int = 4
    """``encoding='lossy'``: the width of the optimizer moments' codes, 4 or 8 bits.  4, the default, writes half
    the bytes of 8 for an error 18x larger; measured on the bench family (``layerckpt bench --policy``), the
    loss after restore moved by 0.1 points at most either way.  ``layerckpt inspect`` shows what it was."""
    pretrained: Optional[str] = None
    """The pretrained weights the training started from: a safetensors file, or a folder of them (a sharded
    checkpoint).  A frozen tensor a save proves bit-identical to one of theirs (every byte, by content: names
    need not agree) is recorded by reference instead of written, in any encoding (one process; with several,
    every tensor is written).  A restore takes such a tensor from the model where the model holds it already
    (built from the same weights, proven by its fingerprint), else from the files its own Config names here.
    The files are only read; a manifest names no path (docs/selection.md, "Pretrained weights by reference")."""
    replicas: int = 0
    """Under torch.distributed with node-local directories (each node its own ``dirpath``; see docs/nodes.md):
    how many partner nodes also hold each node's newest committed part in their memory (a ring: node i's part
    goes to nodes i+1, ..., i+replicas), sent over torch.distributed in the background after each commit.  A
    node lost with its disk and memory then restores its ranks' part from a partner instead of the remote.  Each
    partner holds the newest complete copy and the one arriving (at most twice a node's part in its memory
    tier's base folder, ``LAYERCKPT_SHM`` or /dev/shm).  0: none.  Ignored (logged) on one node or a shared
    directory, where every node reads the same disk."""

    preemption: Optional[Union[bool, str, List[str]]] = None
    """Which signals are a notice of preemption, saved on (docs/failure-semantics.md, "Preemption"): a name
    ("SIGTERM"), several (["SIGTERM", "SIGUSR1"] under SLURM's ``--signal``), True for SIGTERM, [] for notices
    told by ``Checkpointer.preempt()`` only, False for none.  None: the entry point's default, SIGTERM in the
    adapters (LayerCheckpoint, the Accelerate plugin, the Trainer hook); none in a plain Checkpointer, whose
    loop asks ``ckpt.preempted(step)`` at each step.  On a notice every rank saves at one agreed step, where the
    save can be durable before the deadline, then training stops."""
    grace_s: Optional[float] = None
    """Seconds from a notice to the kill that follows it.  None: the signal's convention (SIGTERM 30 s, SIGUSR1
    and SIGUSR2 60 s, SIGINT 10 s), or what ``Checkpointer.preempt(seconds)`` says."""

    def __post_init__(self) -> None:
        self._check_selection()
        self._check_io()
        self._check_tiers()
        _flags(self, "verify_checksums", "restore_rng")
        if self.sign_key is not None:
            from .format._sign import check_key

            check_key(self.sign_key)
        self._check_preemption()

    def _check_preemption(self) -> None:
        from .preempt import signal_names

        if self.preemption is not None and not isinstance(self.preemption, (bool, str, list, tuple)):
            raise ConfigError(f"Config.preemption takes true/false, a signal name or a list of them, got "
                              f"{self.preemption!r}")
        signal_names(self.preemption)  # each a signal this process can handle
        if self.grace_s is not None:
            _number(self, "grace_s", float, lo=0.0)

    def _check_selection(self) -> None:
        """Which layers a save writes: the rule (full, fidelity or threshold) and its bounds."""
        fidelity_given = not isinstance(self.fidelity, _Default)
        _number(self, "fidelity", float, lo=0.0)
        if not fidelity_given:
            self.fidelity = _FIDELITY
        if self.threshold is not None:
            _number(self, "threshold", float, lo=0.0)
        if self.budget_bytes is not None:
            self.budget_bytes = parse_size(self.budget_bytes, "budget_bytes")
            _number(self, "budget_bytes", int, lo=0)
        _number(self, "max_staleness", int, lo=1)
        _number(self, "base_every", int, lo=0)
        _number(self, "drift_sample", int, lo=0)
        self.row_block_bytes = parse_size(self.row_block_bytes, "row_block_bytes")
        _number(self, "row_block_bytes", int, lo=0)
        if self.layers is not None and not (isinstance(self.layers, dict) and all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in self.layers.items())):
            raise ConfigError(f"Config.layers must map name patterns to layer names, got {self.layers!r}")
        _flags(self, "full")
        if self.pretrained is not None:
            if not isinstance(self.pretrained, (str, os.PathLike)) or not os.fspath(self.pretrained):
                raise ConfigError(f"Config.pretrained must be the path of a safetensors file or a folder of them, got "
                                  f"{self.pretrained!r}")
            self.pretrained = os.fspath(self.pretrained)
        self._check_rule(fidelity_given)

    def _check_rule(self, fidelity_given: bool) -> None:
        """One selection rule: full, threshold or fidelity.  ``threshold=0.0`` without a byte cap is full."""
        if self.full:
            _refuse_beside_full(self, fidelity_given)
            self.threshold = 0.0  # the full mode's other spelling: both spellings give one Config
        elif self.threshold == 0.0 and self.budget_bytes is None:
            self.full = True
        if self.threshold is not None and fidelity_given:
            rule = "threshold=0.0 (full checkpoints)" if self.full else f"threshold={self.threshold}"
            raise ConfigError(
                f"Config.{rule} and Config.fidelity={self.fidelity} are two selection rules, and threshold would "
                f"override fidelity; give one: drop fidelity to keep the threshold rule, or drop threshold to "
                f"select by the estimated loss increase")

    def _check_io(self) -> None:
        """How saves and restores move bytes."""
        self.staging_bytes = parse_size(self.staging_bytes, "staging_bytes")
        self.chunk_bytes = parse_size(self.chunk_bytes, "chunk_bytes")
        _number(self, "queue_depth", int, lo=1, hi=256)
        _number(self, "max_inflight", int, lo=1)
        _number(self, "chunk_bytes", int, lo=ALIGN)
        if self.chunk_bytes % ALIGN:
            raise ConfigError(
                f"Config.chunk_bytes must be a multiple of {ALIGN} (O_DIRECT alignment), got {self.chunk_bytes}"
            )
        if self.chunk_bytes > GiB:
            raise ConfigError(f"Config.chunk_bytes must be at most 1GiB, got {self.chunk_bytes}")
        _number(self, "staging_bytes", int, lo=self.chunk_bytes)
        if self.backend not in ("auto", "uring", "threads"):
            raise ConfigError(f"Config.backend must be 'auto', 'uring' or 'threads', got {self.backend!r}")
        _flags(self, "direct_io", "lazy_staging")
        if self.encoding not in ENCODINGS:
            raise ConfigError(f"Config.encoding must be one of {', '.join(map(repr, ENCODINGS))}, got "
                              f"{self.encoding!r}")
        _number(self, "delta_chain", int, lo=1)
        _number(self, "encode_threads", int, lo=0, hi=1024)
        _number(self, "lossy_quantum", float, lo=0.0)
        if not 0 < self.lossy_quantum <= 1e6:
            raise ConfigError(f"Config.lossy_quantum must be above 0 (a fraction of one step's move; 2.0: within one "
                              f"step's move of the saved weights), at most 1e6, got {self.lossy_quantum!r}")
        _number(self, "lossy_bits", int)
        if self.lossy_bits not in (4, 8):
            raise ConfigError(f"Config.lossy_bits must be 4 or 8, got {self.lossy_bits!r}")

    def _check_tiers(self) -> None:
        """Where copies go and how many stay; the remote_* fields only with a remote."""
        _number(self, "keep_last", int, lo=0)
        _number(self, "replicas", int, lo=0, hi=64)
        _flags(self, "memory_tier")
        self._check_remote_every()
        if self.remote_bandwidth is not None:
            self.remote_bandwidth = _bandwidth(self.remote_bandwidth)
            if self.remote is None:
                raise ConfigError("Config.remote_bandwidth caps uploads to the remote tier, but Config.remote is "
                                  "not set; set remote to a URL such as 's3://bucket/prefix' or drop the cap")
        if self.remote_options is None:
            self.remote_options = {}
        check_config(self.remote, self.remote_options)  # imports fsspec only with a remote tier

    def _check_remote_every(self) -> None:
        if self.remote_every != REMOTE_BASES:
            if isinstance(self.remote_every, str):
                raise ConfigError(f"Config.remote_every must be a positive integer (every N-th composite) or "
                                  f"{REMOTE_BASES!r} (base composites only), got {self.remote_every!r}")
            _number(self, "remote_every", int, lo=1)
        elif self.base_every == 0 and not self.full:
            raise ConfigError(f"Config.remote_every={REMOTE_BASES!r} copies base composites only, but with "
                              f"base_every=0 only the first save is one; set base_every=N (a base every N saves) "
                              f"or remote_every=N")
        if self.remote is None and self.remote_every != 1:
            raise ConfigError(f"Config.remote_every={self.remote_every!r} says which composites go to the remote "
                              f"tier, but Config.remote is not set; set remote to a URL such as "
                              f"'s3://bucket/prefix' or drop remote_every")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "config") -> "Config":
        """A Config from a mapping of its fields (YAML, JSON, ``to_dict()``, a manifest's recorded config).
        A ``fidelity`` equal to its default counts as not given: ``to_dict()`` and manifests record it beside
        a ``threshold`` they were made with."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping of Config fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown Config field(s) {', '.join(map(str, unknown))}; valid fields: {', '.join(sorted(known))}"
            )
        data = dict(data)
        fid = data.get("fidelity")
        if isinstance(fid, float) and fid == FIDELITY:
            data["fidelity"] = _FIDELITY
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: Union[str, os.PathLike]) -> "Config":
        """Read a YAML mapping of fields; a top-level ``layerckpt:`` key is also accepted."""
        import yaml

        text = _read_yaml_text(path)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from e
        except RecursionError:
            raise ConfigError(f"{path} nests mappings or lists too deeply to be a layerckpt config") from None
        if data is None:
            data = {}
        if isinstance(data, Mapping) and set(data) == {"layerckpt"}:
            data = data["layerckpt"] or {}
        return cls.from_dict(data, where=str(path))

    def __repr__(self) -> str:
        """Every field, ``remote_options`` values redacted: they hold credentials, and a repr ends up in logs."""
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["remote_options"] = redacted(self.remote_options)
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    __str__ = __repr__

    def to_dict(self) -> Dict[str, Any]:
        """Every field, but ``sign_key`` (a secret: a dict ends up in JSON reports and logs)."""
        return _plain(dataclasses.asdict(dataclasses.replace(self, sign_key=None)))

    def recorded(self) -> Dict[str, Any]:
        """What a manifest records: every field but ``remote_options`` (it may hold credentials), ``sign_key``
        (the secret) and ``pretrained``
        (a manifest names no path to open; which tensors it holds by reference, ``Manifest.pretrained`` says)."""
        return _plain(dataclasses.asdict(dataclasses.replace(self, remote_options={}, pretrained=None,
                                                             sign_key=None)))

    def replace(self, **changes: Any) -> "Config":
        """A validated copy with ``changes``.  On a full Config, a new ``threshold`` or ``budget_bytes``
        decides the mode afresh (``threshold=0.1``: the threshold rule), and ``full=False`` drops the
        ``threshold=0.0`` that spelled it (back to the fidelity rule)."""
        if self.full and "full" not in changes and ("threshold" in changes or "budget_bytes" in changes):
            changes["full"] = False
        elif self.full and changes.get("full") is False and "threshold" not in changes:
            changes["threshold"] = None
        return dataclasses.replace(self, **changes)


GROUPS: Dict[str, Tuple[str, ...]] = {
    "selection": ("full", "fidelity", "threshold", "budget_bytes", "max_staleness", "base_every", "drift_sample",
                  "row_block_bytes", "layers", "pretrained"),
    "io": ("staging_bytes", "chunk_bytes", "queue_depth", "max_inflight", "lazy_staging", "backend", "direct_io",
           "encoding", "delta_chain", "encode_threads", "lossy_quantum", "lossy_bits"),
    "tiers": ("keep_last", "memory_tier", "remote", "remote_options", "remote_every", "remote_bandwidth", "replicas"),
    "restore": ("verify_checksums", "restore_rng", "sign_key"),
    "preemption": ("preemption", "grace_s"),
}
"""Every Config field, once, by what it governs (docs/configuration.md's Config table follows it)."""


#: the most bytes a YAML config file may hold
MAX_YAML_BYTES = 16 << 20


def _read_yaml_text(path: Union[str, os.PathLike]) -> str:
    """The text of a YAML config file: a regular file (never waited on: a FIFO is refused), of at most
    MAX_YAML_BYTES, in UTF-8; anything else is a ConfigError naming the file."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_YAML_BYTES:
            raise ConfigError(f"config file {path} is not a regular file of at most {MAX_YAML_BYTES >> 20} MiB")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def redacted(options: Any) -> Any:
    """``remote_options`` as shown in a repr, a log or an error: the option names, every value hidden."""
    if not isinstance(options, Mapping):
        return "<redacted>" if options else options
    return {k: "<redacted>" for k in options}


def _refuse_beside_full(cfg: Config, fidelity_given: bool) -> None:
    """Full mode writes every layer: a field that would pick or cap layers contradicts it."""
    for name, clash, why in (
            ("threshold", cfg.threshold not in (None, 0.0), "would select layers by drift"),
            ("budget_bytes", cfg.budget_bytes is not None, "would cap the bytes a save writes"),
            ("fidelity", fidelity_given, "would let a save skip layers")):
        if clash:
            raise ConfigError(f"Config.full=True writes every layer at every save, but Config.{name}="
                              f"{getattr(cfg, name)!r} {why}; drop {name} (or full)")


def _bandwidth(value: Any) -> int:
    bw = value
    if isinstance(bw, str) and bw.strip().lower().endswith("/s"):
        bw = bw.strip()[:-2]
    try:
        bw = parse_size(bw, "remote_bandwidth")
        if bw >= 1:
            return bw
    except ConfigError:
        pass
    raise ConfigError(f"Config.remote_bandwidth must be bytes per second such as '200MB', '1GiB/s' or "
                      f"200000000 (None: no cap), got {value!r}")


def _plain(d: Dict[str, Any]) -> Dict[str, Any]:
    d["fidelity"] = float(d["fidelity"])  # the default's marker stays in the object: YAML dumps plain floats
    return d


def _flags(cfg: Config, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"Config.{name} must be true or false, got {getattr(cfg, name)!r}")


def _number(cfg: Config, name: str, kind: type, lo: Optional[float] = None, hi: Optional[float] = None) -> None:
    v = getattr(cfg, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is int:
        ok = ok and float(v).is_integer()
    if not ok:
        raise ConfigError(f"Config.{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    v = kind(v)
    if v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"Config.{name} must be {rng}, got {getattr(cfg, name)!r}")
    setattr(cfg, name, v)
