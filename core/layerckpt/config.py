"""The one Config of layerckpt: a validated dataclass, loadable from YAML."""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional, Union

from .errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths
REMOTE_BASES = "base"  # Config.remote_every: base composites only

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": KiB, "kb": 1000, "kib": KiB, "m": MiB, "mb": 1000**2, "mib": MiB,
          "g": GiB, "gb": 1000**3, "gib": GiB, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size(value: Union[int, str], name: str) -> int:
    """Accept 16777216, "16MiB", "1.5GiB", "512kb"."""
    if isinstance(value, bool):
        raise ConfigError(f"Config.{name} must be a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and (m.group(2) or "").lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    raise ConfigError(f"Config.{name} must be a byte count such as 16777216 or '16MiB', got {value!r}")


@dataclass
class Config:
    """What to persist, when, and how to write it.

    ``Config(threshold=0.0)`` persists every layer at every save (a full checkpoint).
    """

    fidelity: float = 0.004
    """The default selection rule's one knob, with no scale of its own: layers are skipped, cheapest first,
    while a restore of the composite is estimated (first order, from the optimizer's gradient averages) to
    raise the training loss by at most this fraction of it.  Needs the loss: ``save(step, loss=...)``,
    which the Lightning and Accelerate adapters pass; without it a conservative stand-in applies.
    0.0 writes every layer that moved."""
    threshold: Optional[float] = None
    """Instead of the fidelity budget: persist a layer once its relative drift ||W - W_p|| / ||W_p|| reaches this
    (0.0: every layer at every save, a full checkpoint)."""
    max_staleness: int = 16
    """A layer that moves may lag at most this many checkpoints; at the bound it is persisted regardless."""
    base_every: int = 0
    """Write a full (every-layer) checkpoint every N checkpoints; 0 never forces one after the first."""
    keep_last: int = 2
    """Composites kept restorable; older manifests (and data no kept manifest needs) are deleted. 0 keeps all."""
    staging_bytes: int = 4 * GiB
    """Bound on pooled host staging memory; a save needing more waits for the flusher (back-pressure)."""
    chunk_bytes: int = 16 * MiB
    """Size of one staging buffer and of one write; small tensors are coalesced into it."""
    queue_depth: int = 8
    """Writes (or reads) in flight at once."""
    max_inflight: int = 1
    """Saves in flight at once; the next save() waits while this many are flushing.  Selective saves too, in
    one process: each plans on the one before it (across ranks a selective save waits for the one before)."""
    lazy_staging: bool = True
    """With an optimizer: save() returns once it has decided what to write (the buffers, RNG and extra
    copied); the parameters and optimizer state are copied in the background while training goes on, and
    ``optimizer.step()`` waits for those copies (after its closure, if it has one).  Needs the weights to
    change only through that optimizer's step until the copies are done: a save whose tensors changed
    otherwise meanwhile fails (nothing committed).  False copies everything before save() returns."""
    backend: str = "auto"
    """'auto' (io_uring, else threads), 'uring' or 'threads'; LAYERCKPT_BACKEND overrides."""
    direct_io: bool = True
    """Write and read with O_DIRECT (bypassing the page cache) where the file system allows it."""
    verify_checksums: bool = True
    """Check every tensor's CRC32C on restore."""
    restore_rng: bool = True
    """Restore the python/numpy/torch RNG states saved with the checkpoint."""
    budget_bytes: Optional[int] = None
    """Optional cap on the bytes one checkpoint writes: drifted layers go most-drifted first; forced ones always."""
    drift_sample: int = 16384
    """Elements per layer sampled to estimate drift (0: every element; exact, but keeps a copy of the weights)."""
    row_block_bytes: int = 1 * MiB
    """Embedding tables (``nn.Embedding``/``nn.EmbeddingBag`` weights, tied heads too) at least twice this big
    are selected in blocks of this many bytes of rows, each block with the same rows of its optimizer state,
    so a checkpoint writes only the blocks that moved; 0 keeps every table whole."""
    layers: Optional[Dict[str, str]] = None
    """Glob patterns of state_dict names -> layer name, overriding the automatic grouping (first match wins)."""
    memory_tier: bool = False
    """Also keep the newest composite in shared memory (/dev/shm/layerckpt-<hash of the directory>/, same format):
    a restart after a process crash restores from there; after a node restart it is gone and the disk is read."""
    remote: Optional[str] = None
    """An fsspec URL ('s3://bucket/prefix', 'gs://...', 'file:///mnt/nfs/run1', 'memory://run1') the committed
    composites are copied to in the background, data first and the manifest last (the remote commit point).
    restore() and the CLI take the URL.  Needs ``pip install 'layerckpt[remote]'`` (fsspec, s3fs)."""
    remote_options: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the fsspec file system (key/secret, client_kwargs={'endpoint_url': ...}, ...);
    never written into a manifest."""
    remote_every: Union[int, str] = 1
    """Copy every N-th composite to the remote tier (the first, then each N-th); a failed copy is retried with
    the next composite.  ``"base"``: base composites only, those that carry no layer from an older save (the
    first, every ``base_every``-th, and every save with ``threshold=0.0``), so the remote holds only
    composites that restore from their own files."""
    remote_bandwidth: Optional[int] = None
    """Cap on the remote tier's upload speed, bytes per second over all its uploads at once ('200MB', '1GiB/s',
    or a number); None: as fast as the network goes.  Uploads take longer; training is not slowed."""

    def __post_init__(self) -> None:
        self.staging_bytes = parse_size(self.staging_bytes, "staging_bytes")
        self.chunk_bytes = parse_size(self.chunk_bytes, "chunk_bytes")
        if self.budget_bytes is not None:
            self.budget_bytes = parse_size(self.budget_bytes, "budget_bytes")
            _number(self, "budget_bytes", int, lo=0)
        _number(self, "drift_sample", int, lo=0)
        self.row_block_bytes = parse_size(self.row_block_bytes, "row_block_bytes")
        _number(self, "row_block_bytes", int, lo=0)
        if self.layers is not None and not (isinstance(self.layers, dict) and all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in self.layers.items())):
            raise ConfigError(f"Config.layers must map name patterns to layer names, got {self.layers!r}")
        _number(self, "fidelity", float, lo=0.0)
        if self.threshold is not None:
            _number(self, "threshold", float, lo=0.0)
        _number(self, "max_staleness", int, lo=1)
        _number(self, "base_every", int, lo=0)
        _number(self, "keep_last", int, lo=0)
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
        if self.remote_every != REMOTE_BASES:
            if isinstance(self.remote_every, str):
                raise ConfigError(f"Config.remote_every must be a positive integer (every N-th composite) or "
                                  f"{REMOTE_BASES!r} (base composites only), got {self.remote_every!r}")
            _number(self, "remote_every", int, lo=1)
        elif self.base_every == 0 and not (self.threshold == 0.0 and self.budget_bytes is None):
            raise ConfigError(f"Config.remote_every={REMOTE_BASES!r} copies base composites only, but with "
                              f"base_every=0 only the first save is one; set base_every=N (a base every N saves) "
                              f"or remote_every=N")
        if self.remote_bandwidth is not None:
            bw = self.remote_bandwidth
            if isinstance(bw, str) and bw.strip().lower().endswith("/s"):
                bw = bw.strip()[:-2]
            try:
                self.remote_bandwidth = parse_size(bw, "remote_bandwidth")
                _number(self, "remote_bandwidth", int, lo=1)
            except ConfigError:
                raise ConfigError(f"Config.remote_bandwidth must be bytes per second such as '200MB', '1GiB/s' or "
                                  f"200000000 (None: no cap), got {self.remote_bandwidth!r}") from None
            if self.remote is None:
                raise ConfigError("Config.remote_bandwidth caps uploads to the remote tier, but Config.remote is "
                                  "not set; set remote to a URL such as 's3://bucket/prefix' or drop the cap")
        if self.remote_options is None:
            self.remote_options = {}
        if self.remote is not None or self.remote_options:  # fsspec is needed only with a remote tier
            from ._remote import check_config

            check_config(self.remote, self.remote_options)
        for name in ("direct_io", "verify_checksums", "restore_rng", "memory_tier", "lazy_staging"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Config.{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "config") -> "Config":
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping of Config fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown Config field(s) {', '.join(map(str, unknown))}; valid fields: {', '.join(sorted(known))}"
            )
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: Union[str, os.PathLike]) -> "Config":
        """Read a YAML mapping of fields; a top-level ``layerckpt:`` key is also accepted."""
        import yaml

        try:
            with open(path, "r", encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from e
        if data is None:
            data = {}
        if isinstance(data, Mapping) and set(data) == {"layerckpt"}:
            data = data["layerckpt"] or {}
        return cls.from_dict(data, where=str(path))

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def recorded(self) -> Dict[str, Any]:
        """What a manifest records: every field but ``remote_options`` (it may hold credentials)."""
        return dataclasses.asdict(dataclasses.replace(self, remote_options={}))

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


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
