"""One local read of a committed composite: its manifest, then the tensors asked for, file by file.

``restore`` and ``read_checkpoint`` open a :class:`Reader` on a local view
(``_fetch.view``: the directory itself, its memory tier's folder, or a remote
composite downloaded) and read from it once.  A tensor stored in pieces (row
blocks, or boxes of any DTensor layout) comes back whole, or only the boxes a
rank's shard takes, each copied from the pieces overlapping it; model tensors are read
straight into their memory through a few reused bounce buffers, everything else
into one fresh buffer per file (``_read``).  A damaged tensor or file is
reported with the layer, and the step, it belongs to.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import stat
import threading
from typing import AbstractSet, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

from .. import _faults
from ..format import _store
from ..io._backend import checksum_function, make_backend
from ._fetch import View
from ..write._flush import wait_for_saves
from ..write._gather import layout_boxes, shard_rows, shards_dim
from ..format._json import _kind
from ..format._layout import CODES
from ..format import _sign
from ..format._manifest import Manifest, load_manifest
from ..format._encode import reads_ref
from ._encread import read_encoded, span
from ._read import MissingDataError, Want, prefetch, read_into, read_views
from ..write._stage import BufferPool
from ..config import Config
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointGoneError, CheckpointNotFoundError

F = TypeVar("F", bound=Callable)


def retry_gone(fn: F) -> F:
    """``restore``/``read_checkpoint``: where no step was asked for and retention deleted the newest composite
    while it was being read (:class:`CheckpointGoneError`), read the newest again, once.  Readers never lock,
    so a writer's ``keep_last`` may always win such a race; a second loss is raised."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CheckpointGoneError:
            given = sig.bind(*args, **kwargs).arguments
            path = next(iter(given.values()))
            named = isinstance(path, (str, os.PathLike)) and _store.manifest_step(
                os.path.basename(os.fspath(path))) is not None  # a manifest's path asks for its step
            if given.get("step") is not None or named:
                raise
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def open_reader(v: View, config: Optional[Config], *, manifest_paths: bool) -> Iterator["Reader"]:
    """A :class:`Reader` of the composite the local view ``v`` names (see :func:`locate`), closed on exit."""
    root, mpath = locate(v, manifest_paths)
    r = Reader(root, mpath, config)
    try:
        yield r
    finally:
        r.close()


def locate(v: View, manifest_paths: bool) -> Tuple[str, str]:
    """(directory, manifest path) of the composite ``v`` names: its step's, else the newest committed.  With
    ``manifest_paths`` (``read_checkpoint``) ``v.path`` may also be one of the directory's manifests."""
    if not manifest_paths:
        root = _store.local_path(v.path)
        wait_for_saves(root)  # a save of this process into root commits (or fails) first
        return root, _store.resolve(root, v.step)
    root, located = _store.locate(v.path)
    wait_for_saves(root)
    if v.step is not None and located is not None and v.step != located:
        raise CheckpointError(f"{v.path} is the checkpoint of step {located}, but step={v.step} was asked for")
    return root, _store.resolve(root, located if v.step is None else v.step)


class Reader:
    """The manifest ``m`` of one committed composite in the local directory ``root``, and its tensors read
    with the checksum, backend and bounce buffers the Config chooses; ``bytes_read`` counts what was read."""

    def __init__(self, root: str, mpath: str, config: Optional[Config]):
        self.root, self.mpath = root, mpath
        self.cfg = config or Config()
        key = _sign.key_of(self.cfg)
        try:  # a signed store's manifest (with a key): its signature, its store and its files' digests first
            self.m = load_manifest(mpath) if key is None else _sign.load_signed(root, mpath, key)
        except CheckpointNotFoundError:  # it was there when the composite was picked
            raise CheckpointGoneError(f"the checkpoint {mpath} was deleted while it was being read",
                                      path=mpath) from None
        _faults.point("read.manifest-loaded")  # the composite is picked and its manifest held, nothing read yet
        self.check = checksum_function(self.m.checksum) if self.cfg.verify_checksums else None
        self.bytes_read = 0
        self.backend = _LazyBackend(self.cfg)  # made at its first use
        self._pool: Optional[BufferPool] = None
        self._prefetch: Optional[threading.Thread] = None
        self._advised: FrozenSet[Tuple[str, str]] = frozenset()  # (data file, key) a prefetch asked for or found cached

    def tensors(self, keys: List[str], windows: Optional[Dict[str, "Window"]] = None) -> Dict[str, torch.Tensor]:
        """The named tensors in fresh memory (see :func:`read_tensors`)."""
        with self._naming_layers():
            out, n = read_tensors(self.root, self.m, self.mpath, keys, self.backend, self.check, self.cfg, windows,
                                  self._advised)
        self.bytes_read += n
        return out

    def into(self, pairs: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Each (key, tensor) pair's stored tensor read straight into the tensor's memory (a DTensor's: the boxes
        of the whole tensor its shard holds); a tensor that cannot be written in place is read into a
        contiguous copy, then copied."""
        targets = []
        copy_back = []
        for key, dest in pairs:
            t = dest.to_local().detach() if hasattr(dest, "to_local") else dest.detach()
            work = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
            if work is not t:
                copy_back.append((t, work))
            targets.extend((key, work[sl] if sl else work, o, z) for o, z, sl in local_boxes(dest))
        if self._pool is None:
            self._pool = BufferPool(self.cfg.chunk_bytes, self.cfg.chunk_bytes * min(4, self.cfg.queue_depth))
        with self._naming_layers():
            _, n = _read_targets(self.root, self.m, self.mpath, targets, [], self.backend, self._pool, self.check,
                                 self.cfg, self._advised)
        self.bytes_read += n
        with torch.no_grad():
            for t, work in copy_back:
                t.copy_(work)

    def prefetch(self, groups: Sequence[Sequence[str]]) -> None:
        """Ask the disk at once, on a helper thread, for the stored bytes of every group of keys that will be read
        buffered (``_read.prefetch``), a group after the one before it, ahead of the reads that want them one
        file, one tensor at a time.  A tensor stored in pieces is left to its read: a rank reads only the
        pieces its shard overlaps."""
        asks = []
        for keys in groups:
            by_file: Dict[str, List[Want]] = {}
            for k in keys:
                e = self.m.tensors.get(k)
                if e is not None and e.enc is None and e.file in self.m.files and self.m.pieces(k) is None:
                    by_file.setdefault(e.file, []).append(Want.from_entry(k, e, self.m.files[e.file].step))
            for fname, wants in sorted(by_file.items()):
                try:
                    path = _store.safe_join(self.root, _store.DATA_DIR, fname, f"manifest {self.mpath}")
                except CheckpointError:
                    continue  # the read names it
                asks.append((path, self.m.files[fname].size, wants))
        self._prefetch, self._advised = prefetch(asks, direct=self.cfg.direct_io)

    @contextlib.contextmanager
    def _naming_layers(self) -> Iterator[None]:
        try:
            yield
        except MissingDataError as e:
            if os.path.exists(self.mpath):  # its manifest is still committed: real damage
                raise with_layer(e, self.m) from None
            raise with_layer(CheckpointGoneError(
                f"data file {e.path} of the checkpoint {self.mpath} was deleted while it was being read",
                path=e.path, tensor=e.tensor), self.m) from None
        except CheckpointCorruptError as e:
            raise with_layer(e, self.m) from None

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.join()  # it holds descriptors of the store's files
        self.backend.close()
        if self._pool is not None:
            self._pool.close()


class _LazyBackend:
    """The Config's I/O backend, made at its first use: a restore whose files are all read buffered (small,
    cached, or in memory) never probes io_uring nor opens a ring (about 3 ms of a 40 MB resume)."""

    def __init__(self, cfg: Config):
        self._cfg = cfg
        self._real = None

    def __getattr__(self, name: str):
        if self._real is None:
            self._real = make_backend(self._cfg.backend, self._cfg.queue_depth)
        return getattr(self._real, name)

    def close(self) -> None:
        if self._real is not None:
            self._real.close()


#: a shard to read a tensor into: (its local shape, its boxes ``(offsets, sizes, local slices)`` of the whole)
Window = Tuple[Tuple[int, ...], List[Tuple[List[int], List[int], Tuple[slice, ...]]]]


def read_tensors(root: str, m: Manifest, mpath: str, keys: List[str], backend, check, cfg: Config,
                 windows: Optional[Dict[str, Window]] = None, advised: AbstractSet[Tuple[str, str]] = frozenset()
                 ) -> Tuple[Dict[str, torch.Tensor], int]:
    """Read the named tensors of manifest ``m`` (file by file, checksums verified); a tensor stored in
    pieces (row blocks, boxes) comes back whole, or, for a key in ``windows``, only the shard the window
    names (e.g. this rank's), read from the pieces that overlap it.  ``advised``: the (data file path, key) of
    the tensors a prefetch has asked the disk for or found in the page cache (:meth:`Reader.prefetch`)."""
    windows = windows or {}
    check_claims(root, m, mpath, keys)
    out: Dict[str, torch.Tensor] = {}
    targets: List[Tuple[str, torch.Tensor, List[int], List[int]]] = []
    plain: List[str] = []
    for k in keys:
        desc = m.describe(k)
        if desc is None:
            raise CheckpointCorruptError(f"manifest {mpath} refers to tensor {k!r} but has no entry for it",
                                         path=mpath, tensor=k)
        if k in windows:
            shape, boxes = windows[k]
            out[k] = t = torch.empty(shape, dtype=CODES[desc[0]])
            targets.extend((k, t[sl] if sl else t, o, z) for o, z, sl in boxes)
        elif m.pieces(k) is not None:
            out[k] = t = torch.empty(desc[1], dtype=CODES[desc[0]])
            targets.append((k, t, [0] * len(desc[1]), list(desc[1])))
        else:
            plain.append(k)
    pool = BufferPool(cfg.chunk_bytes, cfg.chunk_bytes * min(4, cfg.queue_depth))  # bounce buffers
    try:
        read, total = _read_targets(root, m, mpath, targets, plain, backend, pool, check, cfg, advised)
    finally:
        pool.close()
    out.update({k: read[k] for k in plain})
    return out, total


def check_claims(root: str, m: Manifest, mpath: str, keys: List[str]) -> None:
    """Before any memory is allocated for them: every file holding the named tensors (and the references their
    deltas read) is a regular file as big as the manifest says (whose entries were checked to lie inside those
    sizes), so a damaged manifest's 4 TB tensor is refused by name instead of asked of the allocator."""
    by_file: Dict[str, List[Tuple[int, str]]] = {}  # file -> (where a tensor's stored bytes end, its key)
    for k in keys:
        pieces = m.pieces(k)
        for pk in [p for p, _, _ in pieces] if pieces is not None else [k] if k in m.tensors else []:
            e = m.tensors[pk]
            by_file.setdefault(e.file, []).append((_end(e), pk))
            ref = e.enc.get("ref") if e.enc is not None else None
            if ref is not None and reads_ref(e.enc["blocks"]):
                by_file.setdefault(ref["file"], []).append((span(ref["blocks"])[1], pk))
    for fname, held in sorted(by_file.items()):
        path = _store.safe_join(root, _store.DATA_DIR, fname, f"manifest {mpath}")
        try:
            st = os.lstat(path)  # the file itself: a link is refused, as the read's own open refuses it
        except FileNotFoundError:
            raise MissingDataError(f"data file {path} is missing (it holds tensor {held[0][1]!r})",
                                   path=path) from None
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else _kind(st.st_mode)
            raise CheckpointCorruptError(f"data file {path} is not a regular file ({kind}); the store is damaged: "
                                         f"restore another step", path=path)
        if st.st_size < m.files[fname].size:
            lost = next((k for end, k in sorted(held) if end > st.st_size), None)
            raise CheckpointCorruptError(
                f"data file {path} is truncated: {st.st_size} bytes, the manifest expects {m.files[fname].size}"
                + (f"; tensor {lost!r} is cut off" if lost else ""), path=path, tensor=lost)


def _end(e) -> int:
    """Where a tensor's stored bytes end in its file."""
    if e.enc is not None:
        return span(e.enc["blocks"])[1]
    return e.offset + e.nbytes


def _read_targets(root: str, m: Manifest, mpath: str, targets, plain: List[str], backend, pool, check,
                  cfg: Config, advised: AbstractSet[Tuple[str, str]] = frozenset()
                  ) -> Tuple[Dict[str, torch.Tensor], int]:
    """Read the ``plain`` keys into fresh memory, and each target's box (see :func:`_route`) into the
    target, file by file; returns the fresh tensors and the bytes read."""
    direct, partial = _route(m, targets)
    by_file: Dict[str, List[Want]] = {}
    encoded: List[str] = []
    for k in list(dict.fromkeys(plain + sorted({src for src, _, _ in partial}))) + list(direct):
        e = m.tensors[k]
        if e.enc is not None:
            encoded.append(k)
        else:
            by_file.setdefault(e.file, []).append(Want.from_entry(k, e, m.files[e.file].step))
    total = 0
    read: Dict[str, torch.Tensor] = {}
    if encoded:
        read, total = read_encoded(root, m, mpath, encoded, {k: direct[k] for k in encoded if k in direct},
                                   backend, check, cfg)
    with torch.no_grad():
        for fname, wants in sorted(by_file.items()):
            path = _store.safe_join(root, _store.DATA_DIR, fname, f"manifest {mpath}")
            ins = [w for w in wants if w.key in direct]
            if ins:
                total += read_into(backend, pool, path, m.files[fname].size, ins, direct, check, direct=cfg.direct_io,
                                   advised=all((path, w.key) in advised for w in ins))
            rest = [w for w in wants if w.key not in direct]
            if rest:
                views, n = read_views(backend, path, m.files[fname].size, rest, check, cfg.chunk_bytes,
                                      direct=cfg.direct_io, advised=all((path, w.key) in advised for w in rest))
                read.update(views)
                total += n
        _copy_partial(partial, read)
    return read, total


def _route(m: Manifest, targets) -> Tuple[Dict[str, torch.Tensor], List[Tuple[str, torch.Tensor, Tuple[slice, ...]]]]:
    """Where each stored piece of the targets (key, tensor, offsets, sizes: the box of the whole tensor the
    tensor takes) goes: straight into the target's memory where the piece lies inside it as one run of its
    bytes (``direct``: piece key -> byte view), else read whole and only its overlap copied (``partial``:
    (piece key, the overlap's view in the target, the overlap's slices of the piece))."""
    direct: Dict[str, torch.Tensor] = {}
    partial: List[Tuple[str, torch.Tensor, Tuple[slice, ...]]] = []
    for key, t, o, z in targets:
        flat = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else None
        parts = m.pieces(key)
        if parts is None:
            shape = list(m.tensors[key].shape)
            parts = [(key, [0] * len(shape), shape)]
        for pk, po, pz in parts:
            lo = [max(a, b) for a, b in zip(o, po)]
            hi = [min(a + n, b + k) for a, n, b, k in zip(o, z, po, pz)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            inside = lo == list(po) and hi == [b + k for b, k in zip(po, pz)]
            if flat is not None and inside and (not o or (list(po[1:]) == list(o[1:]) and list(pz[1:]) == list(z[1:]))):
                row = t[0].numel() * t.element_size() if t.dim() else t.element_size()
                first = (po[0] - o[0]) if o else 0
                direct[pk] = flat[first * row:(first + (pz[0] if o else 1)) * row]
            else:
                dst = t[tuple(slice(a - b, c - b) for a, b, c in zip(lo, o, hi))]
                partial.append((pk, dst, tuple(slice(a - b, c - b) for a, b, c in zip(lo, po, hi))))
    return direct, partial


def _copy_partial(partial, read: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for src, dst, sl in partial:
            v = read[src]
            dst.copy_(v.reshape(dst.shape) if v.dim() == 0 else v[sl])


def local_boxes(t: torch.Tensor) -> List[Tuple[List[int], List[int], Tuple[slice, ...]]]:
    """The boxes of the saved (whole) tensor that a restore writes into ``t``: ``(offsets, sizes, slices of its
    local tensor)``; a DTensor sharded in any layout takes its shard's boxes, anything else the whole."""
    if is_sharded(t):
        layout = layout_boxes("tensor", t)
        return layout.boxes[layout.shard_coord(tuple(t.device_mesh.get_coordinate()))]
    shape = list(t.shape)
    return [([0] * len(shape), shape, ())]


def local_rows(t: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """The tensor a restore writes into, and the rows of the saved tensor it takes: a DTensor sharded on
    dim 0 of a 1-D mesh takes its shard's rows, into its local tensor; anything else every row."""
    if hasattr(t, "to_local"):
        mesh = t.device_mesh
        a, b = shard_rows(t.shape[0], mesh.size(), mesh.get_local_rank()) if is_row_sharded(t) else (0, t.shape[0])
        return t.to_local().detach(), a, b
    return t.detach(), 0, t.shape[0] if t.dim() else 1


def is_row_sharded(t) -> bool:
    from torch.distributed.tensor import Shard

    return t.device_mesh.ndim == 1 and isinstance(t.placements[0], Shard) and t.placements[0].dim == 0


def is_sharded(t) -> bool:
    """A DTensor sharded (on any dim of any mesh dim), not only replicated."""
    return hasattr(t, "to_local") and any(shards_dim(p) for p in t.placements)


def with_layer(e: CheckpointCorruptError, m: Manifest) -> CheckpointCorruptError:
    """Say which layer, and the step it was persisted at, a damaged tensor or file belongs to."""
    where = []
    for name, info in sorted(m.layers.items()):
        if (e.tensor is not None and e.tensor in info.tensors) or (
                e.tensor is None and e.path is not None and os.path.basename(e.path) == info.file):
            where.append(f"layer {name!r} persisted at step {info.step}")
    if not where:
        return e
    shown = ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")
    out = CheckpointCorruptError.__new__(type(e))  # the same kind: a CheckpointGoneError stays one
    CheckpointCorruptError.__init__(out, f"{e} [{shown}]", path=e.path, tensor=e.tensor)
    out.layers = [w.split("'")[1] for w in where]
    return out

