"""Tiers beyond the local directory: after each local commit, a copy of the composite in shared memory
(``Config.memory_tier``) and on remote storage (``Config.remote``), made in the background.

One thread per tier copies the newest composite it was offered: first the data
files the tier does not hold yet, then the manifest, the tier's commit point,
then the tier's own retention by reference (manifests first, then data no kept
manifest references, leftovers of interrupted copies included).  The remote
tier copies every ``remote_every``-th composite, or base composites only, and
its uploads share one token bucket when ``remote_bandwidth`` caps them.  Copies never
block training: the flusher only queues the composite (``Tiers.committed``),
and while a tier copies from a composite the local retention keeps it
(``Retention.hold``).  When copies fall behind, a queued composite is replaced by
a newer one.  A failed copy is logged and retried with the next composite;
``wait()``/``close()`` of the Checkpointer raise it if the tier is still
behind.  One writer per tier, as per directory: the tier's retention deletes
what its manifests do not reference.
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AbstractSet, Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from .. import _faults, _registry
from ..write import _commit, _retain
from ..format import _sign, _store
from ..format._json import loads_strict
from ..format._manifest import Manifest, head_first
from ._memtier import base_hint, make_private, memory_path, record_origin
from ._remote import DATA, MANIFESTS, FsspecStore, LocalStore
from ..config import REMOTE_BASES, Config
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointWriteError

log = logging.getLogger("layerckpt")

COPIES_IN_FLIGHT = 4  # files copied at once by one tier
INCOMING = "incoming"  # the memory tier's folder of the staged copies the flusher makes (Tiers.incoming)
wait_for_tiers = _registry.wait_for_tiers  # read your writes: this process's copies into a tier URL or folder


def read_all(store) -> Tuple[Dict[str, Manifest], List[str]]:
    """A tier's committed manifests that parse, by name, and the names of those that do not."""
    good: Dict[str, Manifest] = {}
    bad: List[str] = []
    for n in store.names(MANIFESTS):
        if _store.manifest_step(n) is None:
            continue
        try:
            where = store.where(MANIFESTS, n)
            good[n] = Manifest.from_dict(loads_strict(store.read(MANIFESTS, n), where), where)
        except FileNotFoundError:  # retention removed it since the listing
            continue
        except (ValueError, UnicodeDecodeError, CheckpointCorruptError):
            bad.append(n)
    return good, bad


BAD_ID = "unreadable"  # a tier's identity file that is damaged: it matches no store
ID_BYTES = 4096  # the most bytes an identity file may hold (it holds 33)


def tier_id(store) -> Optional[str]:
    """The store identity a tier carries (copied there by the writer that created it), None without one,
    ``BAD_ID`` where it cannot be read (logged, with why)."""
    found, why = _tier_id(store)
    if why is not None:
        log.warning("layerckpt: the store identity of the tier %s cannot be read: %s", store.url, why)
    return found


def _tier_id(store) -> Tuple[Optional[str], Optional[str]]:
    """(the tier's identity, None, or BAD_ID; why it cannot be read, or None)."""
    where = store.where("", _store.STORE_ID)
    try:
        raw = store.read("", _store.STORE_ID, "store identity", ID_BYTES)
    except (FileNotFoundError, CheckpointNotFoundError):
        return None, None
    except (OSError, CheckpointCorruptError) as e:
        return BAD_ID, str(e)
    try:
        return _store.parse_store_id(raw, where), None
    except CheckpointCorruptError as e:
        return BAD_ID, str(e)


def same_store(local: Optional[str], tier: Optional[str], local_empty: bool = False) -> bool:
    """Whether a tier carrying the identity ``tier`` holds the composites of the store ``local`` names.
    Neither has one: a store and its tier from before identities (trusted as they were).  Only the tier has
    one: the store is a new local place of it (``local_empty``: no composite of its own yet)."""
    if local is None:
        return tier is None or local_empty
    return local == tier


def is_base(m: Manifest) -> bool:
    """Whether ``m`` is a base composite: every layer persisted at its own step and no tensor encoded
    against an older version, so it reads no older file (the first save, a due ``base_every``; a full
    Config's saves where its tensors' references were renewed, or every one with ``encoding`` other than
    'delta')."""
    return all(e.step == m.step for e in m.layers.values()) and not any(
        needs_ref(t) for t in m.tensors.values())


def needs_ref(t) -> bool:
    """Whether a tensor entry reads its reference: it has delta or unchanged blocks (an entry records its
    reference whenever it was encoded against one, so that the reference stays kept while it is one)."""
    from ..format._encode import reads_ref

    return bool(t.enc and t.enc.get("ref") and reads_ref(t.enc["blocks"]))


def _entries(m: Manifest) -> Dict[str, Dict[str, tuple]]:
    """file -> {tensor key: where its bytes are, how they are encoded and their checksum}, for the files ``m``
    references; a file holding a tensor's reference (see ``_encode``) lists it under ``<key>#ref``."""
    out: Dict[str, Dict[str, tuple]] = {f: {} for f in m.files}
    for k, t in m.tensors.items():
        blocks = _blocks(t.enc["blocks"]) if t.enc else None
        here = out.setdefault(t.file, {})
        here[k] = (t.offset, t.nbytes, t.crc, t.dtype, tuple(t.shape), blocks)
        if blocks is not None:  # what a later composite's delta would record of it as its reference
            here[k + "#ref"] = (t.nbytes, t.crc, blocks)
        ref = t.enc.get("ref") if t.enc else None
        if ref:
            out.setdefault(ref["file"], {})[k + "#ref"] = (t.nbytes, ref["crc"], _blocks(ref["blocks"]))
    return out


def _blocks(blocks: List[List[int]]) -> tuple:
    return tuple(tuple(b) for b in blocks)


def place(m: Manifest, good: Dict[str, Manifest], listed: List[str], copies: Optional[Dict[str, tuple]] = None
          ) -> Tuple[Dict[str, str], List[str]]:
    """Where each file of ``m`` lives on the tier, and which to copy.

    A committed tier file serves a local one when it has its size and, for every tensor ``m`` reads from
    it, the same offset, length and checksum (recorded by a tier manifest); such a file is never copied
    again.  ``copies``: local file -> (tier name, entries, size) of its encoded copies on the tier
    (``_transcode``), which serve it where they hold every tensor ``m`` reads from it.  A name a tier
    manifest uses for other bytes is never overwritten: the copy gets a fresh name.  A file of another step
    never serves one, even holding the same bytes: every checksum is sealed to its file's step (``_places``),
    so their entries differ, and a tier manifest lists each file with the step its seals carry (where the
    entries were written before step seals, such a file may still serve, listed with the newer step, as then).
    Returns ({local name: tier name}, [local names to copy])."""
    known: Dict[str, Dict[str, tuple]] = {}  # tier file -> every tensor entry tier manifests record for it
    size: Dict[str, Tuple[int, str]] = {}
    for tm in good.values():
        for f, ents in _entries(tm).items():
            known.setdefault(f, {}).update(ents)
            size[f] = (tm.files[f].size, tm.checksum)
    taken = set(listed) | set(known)
    where: Dict[str, str] = {}
    copy: List[str] = []
    for f, ents in sorted(_entries(m).items()):
        copy_of = (copies or {}).get(f)
        if copy_of is not None and all(n in known and n in listed for n in copy_of[0]) and all(
                k in copy_of[1] for k, e in m.tensors.items() if e.file == f):
            where[f] = copy_of[0][0]
            continue
        want = (m.files[f].size, m.checksum)
        same = [r for r in [f] + sorted(known) if size.get(r) == want and all(
            known[r].get(k) == e for k, e in ents.items()) and (ents or r == f)]
        if same:
            where[f] = same[0]
            continue
        name = f
        if f in known:  # another file of this name is committed on the tier
            name = fresh_name(m.files[f], taken)
        taken.add(name)
        where[f] = name
        copy.append(f)
    return where, copy


def fresh_name(fe, taken) -> str:
    """The first name of a data file of ``fe``'s step and rank that ``taken`` lacks (``data_name``'s versions
    1, 2, ...)."""
    v = 1
    while _store.data_name(fe.step, fe.rank, v) in taken:
        v += 1
    return _store.data_name(fe.step, fe.rank, v)


def renamed(m: Manifest, where: Dict[str, str]) -> dict:
    """The manifest as the tier holds it: its files under their tier names."""
    d = m.to_dict()
    d["files"] = {where[f]: e for f, e in d["files"].items()}
    for e in d["tensors"].values():
        e["file"] = where[e["file"]]
        if e.get("enc") and e["enc"].get("ref"):
            e["enc"]["ref"]["file"] = where[e["enc"]["ref"]["file"]]
    for e in d["layers"].values():
        if e.get("file") is not None:
            e["file"] = where.get(e["file"], e["file"])
    return d


class Busy:
    """The wall time during which at least one of several overlapping uploads ran: what a tier's rate is
    measured over.  Encoding a copy's next part while its last one uploads is not the tier's time (counted in,
    it would make the tier look slower the more is encoded for it, and so encode more)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._since = 0.0
        self.seconds = 0.0

    def __enter__(self) -> "Busy":
        with self._lock:
            if not self._running:
                self._since = time.perf_counter()
            self._running += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                self.seconds += time.perf_counter() - self._since


class Part(NamedTuple):
    """A node's share of the copies where each node has a directory of its own (``_dist.place``): the files its
    ``ranks`` wrote; whether it ``commits`` the tier's manifest (its memory tier: yes; the remote: rank 0's
    node, once every node's files are there, waiting at most ``wait_s``)."""
    ranks: AbstractSet[int]
    commits: bool
    wait_s: float = 0.0


def push(store, root: str, name: str, m: Manifest, keep_last: int, pinned: AbstractSet[str],
         transcoder=None, bases_only: bool = False, sources: Optional[Sources] = None,
         placed: Optional[Dict[str, Tuple[str, Any]]] = None, part: Optional[Part] = None,
         key: Optional[bytes] = None) -> Tuple[int, int, int]:
    """Copy the composite ``m`` (committed in ``root`` as ``name``) to the tier, commit it there, apply the
    tier's retention.  ``transcoder`` (``_transcode.Transcoder``): a file whose tensors encoding pays for on
    this tier goes as an encoded copy (``bases_only``: no deltas).  ``sources``: copies of a local file in
    memory to take it from instead of the disk (see :meth:`Tiers.sources`); ``placed`` (the memory tier's):
    kept up to date, as each lands, with where every file of ``m`` is on the tier.  ``key``: a signed store's,
    which signs the tier's manifest (its files the local ones byte for byte, their digests carried).  Returns
    (files copied, files the tier already held, bytes uploaded)."""
    good, bad = read_all(store)
    listed = store.names(DATA)
    if transcoder is not None:  # what the tier's retention removed is no reference, nor a copy to reuse, any more
        transcoder.keep_only(set(listed))
    done = transcoder.done if transcoder is not None else {}
    where, todo = place(m, good, listed, done)
    mine = set(where)
    if part is not None:  # this node copies its own files only, under their own names
        mine = {f for f, fe in m.files.items() if fe.rank in part.ranks}
        clash = sorted(f for f in todo if f in mine and where[f] != f)
        if clash:
            raise OSError(errno.EEXIST, f"{clash[0]} of step {m.step} is on the tier with other bytes (a run that "
                                        f"went back to an older step); nothing of this composite was committed "
                                        f"there", store.where(DATA, clash[0]))
        for f in where:
            if f in mine and where[f] != f and f not in todo:  # another name holds its bytes: the others name f
                todo.append(f)
            where[f] = f
        todo = [f for f in todo if f in mine]
    sigs = _entries(m)  # what a copy in memory of a file must hold to stand for it
    if placed is not None:
        for f in (set(where) - set(todo)) & mine:
            placed[f] = (store.where(DATA, where[f]), sigs.get(f))
    copies = {f: done[f] for f in where if f not in todo and f in done and where[f] == done[f][0][0]}
    sent = [0]
    taken = set(listed) | set(where.values()) | {n for tm in good.values() for n in tm.files}
    lock = threading.Lock()

    def fresh(f: str) -> str:
        """A tier name no file uses, for another part of the encoded copy of ``f``."""
        with lock:
            name = fresh_name(m.files[f], taken)
            taken.add(name)
            return name

    busy = Busy()

    def upload(path: str, name: str) -> None:
        with busy:
            store.put_file(path, DATA, name)

    def put(f: str) -> None:
        src = os.path.join(root, _store.DATA_DIR, f)
        modes = transcoder.modes(m, f, bases_only) if transcoder is not None else None
        if modes is None:
            if not _from_memory(store, sources(f, sigs.get(f)) if sources is not None else (), m.files[f].size,
                                where[f], upload):
                upload(src, where[f])
            if placed is not None:
                placed[f] = (store.where(DATA, where[f]), sigs.get(f))
            n = m.files[f].size
        else:
            copies[f] = transcoder.write(root, f, m, modes, where[f], lambda: fresh(f), upload)
            n = sum(copies[f][2].values())
        with lock:
            sent[0] += n
        _faults.point("tier.file-copied")

    try:
        if todo:
            with ThreadPoolExecutor(min(COPIES_IN_FLIGHT, len(todo)), thread_name_prefix="layerckpt-copy") as ex:
                for fut in [ex.submit(put, f) for f in todo]:
                    fut.result()
        if transcoder is not None and sent[0]:  # the tier's rate: its bytes over the time an upload ran
            transcoder.sink.observe(sent[0], busy.seconds)
        _faults.point("tier.data-copied")
        if part is not None and not part.commits:  # rank 0's node commits the remote's manifest
            return len(todo), len(where) - len(todo), sent[0]
        if part is not None and part.wait_s:
            _wait_for_parts(store, sorted(where[f] for f in where if f not in mine), part.wait_s, m.step)
        d = renamed(m, where)
        if copies:
            from ..write._transcode import apply

            apply(d, copies, where, m)
        if transcoder is not None:  # what the tier decided for the files it copied now, and why
            d["coding"] = {where[f]: rec for f, rec in transcoder.coding.items() if f in where} or None
        held = set(store.names(DATA))  # a manifest naming a file the tier lacks would be committed unrestorable
        lacking = sorted(n for n in d["files"] if n not in held and (part is None or part.wait_s or n in mine))
        if lacking:
            raise OSError(errno.ENOENT, f"the copy of step {m.step} names {len(lacking)} file(s) the tier does not "
                                        f"hold ({', '.join(lacking[:3])}); nothing of it was committed there",
                          store.where(DATA, lacking[0]))
        body = json.dumps(head_first(d), separators=(",", ":"), allow_nan=True).encode()
        if key is not None:
            body = _sign.sign(body, key)
        # validated before it is committed: a manifest the tier would refuse is never written
        committed = Manifest.from_dict(d, store.where(MANIFESTS, name))
        store.put_bytes(MANIFESTS, name, body)  # the tier's commit point: every file it names is whole
    except BaseException:
        if transcoder is not None:
            transcoder.failed()
        raise
    if transcoder is not None:
        transcoder.committed(m, d)
    _faults.point("tier.committed")
    good[name] = committed
    retain(store, good, bad, keep_last, pinned, spare_after=m.step if part is not None else None)
    if placed is not None:
        for f in [f for f in placed if f not in where]:
            placed.pop(f, None)
    return len(todo), len(where) - len(todo), sent[0]


#: (local data file name, the entries a copy of it must hold) -> [(path of a copy of it in memory, whether the
#: tier may link the file itself into place)]
Sources = Callable[[str, Any], List[Tuple[str, bool]]]


def _from_memory(store, candidates, size: int, name: str, upload: Callable[[str, str], None]) -> bool:
    """Copy a local data file to the tier ``name`` from the first of its copies in memory that is still there
    (a copy may be removed at any time: then the next is tried); False where none was."""
    for path, movable in candidates:
        try:
            if os.path.getsize(path) != size:
                continue
            if not (movable and _link(path, store.where(DATA, name))):
                upload(path, name)
            return True
        except FileNotFoundError:
            continue
    return False


def _link(path: str, dst: str) -> bool:
    """The memory tier's own staged copy linked into place, not copied (the staged name stays for the other
    tiers to read until swept; a later staged copy is a new file); False where the folder's file system
    links no file (the copy is then made)."""
    _commit.unlink_quietly(dst + ".tmp")
    try:
        os.link(path, dst + ".tmp")
    except FileNotFoundError:
        raise
    except OSError:
        return False
    os.replace(dst + ".tmp", dst)
    return True


def _wait_for_parts(store, names: List[str], wait_s: float, step: int) -> None:
    """Until the other nodes' files ``names`` are on the tier (each node uploads its own), at most ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        held = set(store.names(DATA))
        lacking = [n for n in names if n not in held]
        if not lacking:
            return
        if time.monotonic() > deadline:
            raise OSError(errno.ETIMEDOUT, f"the other nodes' files of step {step} did not all reach the tier in "
                                           f"{wait_s:.0f} s ({len(lacking)} lacking, e.g. {lacking[0]}: its node is "
                                           f"gone or slow); nothing of it was committed there",
                          store.where(DATA, lacking[0]))
        time.sleep(0.2)


def retain(store, good: Dict[str, Manifest], bad: List[str], keep_last: int, pinned: AbstractSet[str],
           spare_after: Optional[int] = None) -> None:
    """The tier's retention, by reference as the local one: the ``keep_last`` newest composites and the
    pinned ones stay; other manifests go first, then every data object no kept manifest references.
    ``spare_after``: where the nodes upload their own files, those of later steps stay (a composite still
    arriving)."""
    order = sorted(good, key=_store.recency(good), reverse=True)
    drop = [n for n in order[keep_last:] if n not in pinned] if keep_last > 0 else []
    store.delete(MANIFESTS, drop)
    if drop:
        _faults.point("tier.manifests-dropped")
    store.delete(MANIFESTS, [n for n in store.names(MANIFESTS) if n.endswith(".tmp")])
    if bad:  # what a damaged manifest references is unknown: keep every data object
        log.warning("layerckpt: damaged manifest(s) %s in %s; no data object is deleted", bad, store.url)
        return
    keep = _retain.referenced_files({n: good[n] for n in good if n not in drop})
    store.delete(DATA, [n for n in store.names(DATA)
                        if n not in keep and (_store.is_data_name(n) or n.endswith(".tmp")) and not (
                            spare_after is not None and (_store.data_step(n) or (0,))[0] > spare_after)])


class Tier:
    """One tier's background copier.  ``offer`` (flusher thread) queues a committed composite; one thread
    copies it; ``wait``/``close`` (caller) wait for the copies."""

    def __init__(self, kind: str, store, root: str, keep_last: int, every: Union[int, str], tiers: "Tiers",
                 pins: bool = True):
        self.kind = kind
        self.pins = pins  # whether Checkpointer.keep() composites stay here too
        self.store = store
        self.root = root
        self.keep_last = keep_last
        self.every = every
        self._tiers = tiers
        self._cv = threading.Condition()
        self._queued: Optional[Tuple[str, Manifest]] = None
        self._busy: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self.offered = 0  # composites committed locally since this tier opened
        self.error: Optional[BaseException] = None  # the newest copy's failure; None once one succeeds
        self._reported = True
        self.files_copied = 0
        self.files_reused = 0
        self.bytes_sent = 0  # bytes of data files uploaded (encoded copies at their encoded size)
        #: Config(encoding='auto'), the remote tier: encodes what pays on it (``_transcode``); see Tiers.attach
        self.transcoder = None
        self.sources: Optional[Sources] = None  # copies in memory of the local files (Tiers.sources)
        #: the memory tier's: local data file -> (its path on the tier, the entries it holds), for the newest
        #: composite copied (and the one being copied, as its files land)
        self.placed: Dict[str, Tuple[str, Any]] = {}
        self.part: Optional[Part] = None  # node-local directories: this node's share of the copies
        self.seq = 0  # the highest commit number the tier held at open
        self.newest: Optional[Tuple[int, int]] = None  # (seq, step) of its newest composite at open
        _registry.tier_opened(root, self)

    def open(self, identity: str) -> None:
        """Reach the store (a bad URL, credentials or bucket fail here), make sure it is the store ``identity``'s
        tier (carrying that identity), and read what it holds."""
        try:
            if self.kind == "memory":
                self._claim_memory(identity)
            self.store.prepare()
            self._claim(identity)
            good, _ = read_all(self.store)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - fsspec implementations raise their own types
            raise CheckpointError(
                f"the {self.kind} tier {self.store.url} cannot be written: {type(e).__name__}: {e}; check "
                + ("Config.remote and Config.remote_options (bucket, credentials, endpoint_url)"
                   if self.kind == "remote" else base_hint())) from None
        if good:
            n = _store.newest(good)
            self.newest = (good[n].seq, good[n].step)
            self.seq = max(tm.seq for tm in good.values())

    def _claim_memory(self, identity: str) -> None:
        """The memory tier's folder: private and this user's, else refused; another store's is emptied."""
        why = make_private(self.store.root)
        if why is not None:
            raise CheckpointError(f"the memory tier {self.store.root} cannot be used: {why}; remove it, or name "
                                  f"a private base folder in LAYERCKPT_SHM")
        if tier_id(self.store) != identity:  # left by an earlier store at this path: not ours to continue
            shutil.rmtree(self.store.root)
            make_private(self.store.root)
        record_origin(self.store.root, self.root)  # `layerckpt shm` finds the tier an orphan once the store is gone

    def _claim(self, identity: str) -> None:
        found, why = _tier_id(self.store)
        if found is None:
            self.store.put_bytes("", _store.STORE_ID, (identity + "\n").encode())
        elif found == BAD_ID:
            raise CheckpointError(
                f"the {self.kind} tier {self.store.url} has a store identity that cannot be read ({why}); if the "
                f"tier is this store's, replace the file by a copy of {os.path.join(self.root, _store.STORE_ID)}, "
                f"else name a remote of this store's own")
        elif found != identity:
            raise CheckpointError(
                f"the {self.kind} tier {self.store.url} holds the checkpoints of another store (identity {found}, "
                f"this store's is {identity} in {os.path.join(self.root, _store.STORE_ID)}); name a remote of "
                f"this store's own")

    def held(self) -> AbstractSet[str]:
        with self._cv:
            return {n for n in (self._busy, self._queued[0] if self._queued else None) if n}

    def offer(self, m: Manifest, force: bool = False) -> None:
        if self.every == REMOTE_BASES:  # a failed copy waits for the next base too
            due = is_base(m)
        else:
            due = force or self.error is not None or self.offered % self.every == 0
        self.offered += 1
        if not due:
            if not self.busy():
                self._tiers.past(self, m.step)
            return
        snapshot = Manifest.from_dict(m.to_dict(), "manifest")  # the flusher's object lives on
        with self._cv:
            self._queued = (_store.manifest_name(m.step), snapshot)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"layerckpt-{self.kind}-tier", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._queued is None and not self._stop:
                    self._cv.wait()
                if self._queued is None:
                    return
                (name, m), self._queued = self._queued, None
                self._busy = name
            try:
                pinned = self._tiers.pinned() if self.pins else frozenset()
                copied, reused, sent = push(self.store, self.root, name, m, self.keep_last, pinned, self.transcoder,
                                            bases_only=self.every == REMOTE_BASES, sources=self.sources,
                                            placed=self.placed if self.kind == "memory" else None, part=self.part,
                                            key=_sign.key_of(self._tiers.config))
                self.files_copied += copied
                self.files_reused += reused
                self.bytes_sent += sent
                self.error = None
                log.debug("layerckpt: step %d is committed on the %s tier %s (%d file(s) copied, %d held)",
                          m.step, self.kind, self.store.url, copied, reused)
            except BaseException as e:  # noqa: BLE001 - logged, retried with the next composite, raised at wait()
                self.error = _as_write_error(e, self, m.step)
                self._reported = False
                log.warning("layerckpt: %s", self.error)
            finally:
                with self._cv:
                    self._busy = None
                    self._cv.notify_all()
                self._tiers.released()
                self._tiers.past(self, m.step)

    def busy(self) -> bool:
        """Whether a copy is queued or running."""
        with self._cv:
            return self._working()

    def _working(self) -> bool:  # under self._cv
        return self._queued is not None or self._busy is not None

    def drain(self) -> None:
        """Until nothing is queued or copying."""
        with self._cv:
            while self._working():
                self._cv.wait()

    def wait(self) -> None:
        """Until nothing is queued or copying; raises the newest copy's failure once."""
        self.drain()
        if self.error is not None and not self._reported:
            self._reported = True
            raise self.error

    def close(self) -> None:
        stop_worker(self)


def stop_worker(w) -> None:
    """End a background copier (a :class:`Tier`, ``_replica.Replicas``): its thread finishes what is queued, then
    returns; joined unless called from that thread itself."""
    with w._cv:
        w._stop = True
        w._cv.notify_all()
        t = w._thread
    if t is not None and t is not threading.current_thread():
        t.join()


class Tiers:
    """The memory and remote tiers of one Checkpointer (rank 0): a commit listener of its flusher.  The
    local ``retention`` learns from them what they still copy from, and runs when a copy ends."""

    def __init__(self, root: str, config: Config, retention: _retain.Retention,
                 part: Optional[Tuple[AbstractSet[int], bool]] = None):
        self.root = root
        self.config = config
        self.retention = retention
        self._lock = threading.Lock()
        self.tiers: List[Tier] = []
        if config.memory_tier:
            # the newest composite only: memory is dear, and a crash restarts from the newest
            self.tiers.append(Tier("memory", LocalStore(memory_path(root)), root, 1, 1, self, pins=False))
        if config.remote is not None:
            store = FsspecStore(config.remote, config.remote_options, config.chunk_bytes, config.remote_bandwidth)
            if store.local and os.path.abspath(store.root) == root:
                raise CheckpointError(f"Config.remote {config.remote} is the checkpoint directory itself; "
                                      f"name another place")
            self.tiers.append(Tier("remote", store, root, config.keep_last, config.remote_every, self))
        if part is not None:  # node-local directories: (this node's ranks, whether it is rank 0's node)
            from .._dist import training_timeout_s

            for t in self.tiers:
                first = part[1] if t.kind == "remote" else True
                t.part = Part(frozenset(part[0]), first, training_timeout_s() if t.kind == "remote" and first else 0.0)
        identity = claim_identity(root, [t.store for t in self.tiers if t.kind == "remote"])
        for t in self.tiers:
            t.open(identity)
        self.seq = max(t.seq for t in self.tiers)
        #: where the flusher puts a copy of each data file it writes, made from the same staging buffers as
        #: it writes them (memory tier only): the memory tier links it into place instead of reading the file
        #: back from the disk, and the remote tier uploads from memory
        self.incoming: Optional[str] = None
        self._past: Dict[str, float] = {}  # tier kind -> the step of the composite it last copied or skipped
        memory = next((t for t in self.tiers if t.kind == "memory"), None)
        if memory is not None:
            incoming = os.path.join(memory.store.root, INCOMING)
            shutil.rmtree(incoming, ignore_errors=True)  # an earlier process's: unknown bytes
            try:
                os.mkdir(incoming, 0o700)
            except OSError as e:  # the tiers then read the disk
                log.warning("layerckpt: %s cannot be made (%s); the tiers copy from the disk", incoming, e)
            else:
                self.incoming = incoming
                for t in self.tiers:
                    t.sources = functools.partial(self.sources, memory, t is memory)

    def staged_copy(self, fname: str) -> Optional[str]:
        """Where the flusher may put a copy in memory of the data file ``fname`` it writes; None: nowhere."""
        return None if self.incoming is None else os.path.join(self.incoming, fname)

    def sources(self, memory: Tier, own: bool, f: str, entries: Any) -> List[Tuple[str, bool]]:
        """The copies in memory of the local data file ``f`` (its tensors' ``entries``), for the memory tier
        (``own``: the staged copy, to link into place) or another tier (the staged copy, else the memory
        tier's where it holds the same entries, to read).  The staged copy holds what the flusher wrote last
        under that name, as the local file does."""
        staged = os.path.join(self.incoming, f)
        if own:
            return [(staged, True)]
        held = memory.placed.get(f)
        return [(staged, False)] + ([(held[0], False)] if held is not None and held[1] == entries else [])

    def past(self, tier: Tier, step: float) -> None:
        """``tier`` copied (or skipped) the composite of ``step``: the staged copies of files of that step or
        before are done with once every tier is past them (a file a later composite carries from a skipped
        one is read from the disk)."""
        with self._lock:
            self._past[tier.kind] = step
            if self.incoming is None or len(self._past) < len(self.tiers):
                return
            upto = min(self._past.values())
        self._sweep(upto)

    def _sweep(self, upto: float) -> None:
        """Remove the staged copies of files of step ``upto`` or before."""
        try:
            names = os.listdir(self.incoming)
        except OSError:  # the folder was removed under the run: nothing staged is left to remove
            return
        for n in names:
            at = _store.data_step(n)
            if at is not None and at[0] <= upto:
                _commit.unlink_quietly(os.path.join(self.incoming, n))

    def attach(self, cost, charge) -> None:
        """``Config(encoding='auto')``: the remote tier encodes what the cost model ``cost`` (the flusher's,
        fed by every save's encodes and probes) says pays on it, the CPU charged as ``charge()`` says."""
        from ..select._cost import Sink
        from ..write._transcode import Transcoder

        for t in self.tiers:
            # node-local directories: each node uploads its files raw; a signed store too (an encoded copy's
            # bytes would need a digest of their own)
            if t.kind == "remote" and t.part is None and _sign.key_of(self.config) is None:
                t.transcoder = Transcoder(cost, Sink("remote", cap=self.config.remote_bandwidth), charge,
                                          self.config.delta_chain)

    def catch_up(self) -> None:
        """Queue a copy of the newest local composite where a tier lacks it (a run that was killed while
        copying resumes here)."""
        good, _ = _store.read_all(self.root)
        name = _store.newest(good)
        if name is None:
            return
        m = good[name]
        for t in self.tiers:
            if t.newest is None or t.newest < (m.seq, m.step):
                t.offer(m, force=True)
                t.offered = 0  # the count of remote_every starts with this run's saves
        self._hold()

    def committed(self, m: Manifest) -> None:
        """On the flusher thread, after the local commit and before the local retention."""
        for t in self.tiers:
            try:
                t.offer(m)
            except Exception as e:  # noqa: BLE001 - a tier must never fail the local commit
                log.warning("layerckpt: step %d not queued for the %s tier: %s", m.step, t.kind, e)
        self._hold()

    def pinned(self) -> AbstractSet[str]:
        return self.retention.pinned()

    def _hold(self) -> None:
        """Tell the local retention what to keep for the tiers: the composites they copy or have queued."""
        with self._lock:
            self.retention.hold(n for t in self.tiers for n in t.held())

    def released(self) -> None:
        """A copy ended: what it held may go, by the local retention, on the flusher thread."""
        self._hold()
        self.retention.soon()

    def busy(self) -> bool:
        """Whether any tier has a copy queued or running (what a save still costs the machine after its commit)."""
        return any(t.busy() for t in self.tiers)

    def wait(self) -> None:
        errors = []
        for t in self.tiers:
            try:
                t.wait()
            except CheckpointError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        for t in self.tiers:
            t.close()
        if self.incoming is not None:  # every copy is made: the staged copies are done with
            self._sweep(float("inf"))


def open_tiers(root: str, config: Config, retention: _retain.Retention,
               part: Optional[Tuple[AbstractSet[int], bool]] = None) -> Optional[Tiers]:
    """The tiers of the directory ``root``'s writer (rank 0), or None without any."""
    if not config.memory_tier:
        # a memory tier left by an earlier run of this directory would only shadow this run's saves
        shutil.rmtree(memory_path(root), ignore_errors=True)
    if not config.memory_tier and config.remote is None:
        claim_identity(root, [])
        return None
    return Tiers(root, config, retention, part)


def claim_identity(root: str, remotes: List) -> str:
    """The identity of the store ``root``, made when its writer first opens it: a new local place of a remote
    (no composite of its own yet) takes the remote's, any other store a random one."""
    found = _store.store_id(root)
    if found is not None:
        return found
    adopt = None
    if remotes and not _store.list_manifests(root):
        try:
            adopt = tier_id(remotes[0])
        except Exception:  # noqa: BLE001 - an unreachable remote is reported when the tier opens
            adopt = None
    return _store.ensure_store_id(root, adopt if adopt != BAD_ID else None)


def _as_write_error(e: BaseException, tier: Tier, step: int) -> CheckpointWriteError:
    where = getattr(e, "filename", None) or tier.store.url
    err = getattr(e, "errno", None)
    return CheckpointWriteError(
        err or errno.EIO, str(where), system=bool(err),
        detail=f"copying the composite of step {step} to the {tier.kind} tier {tier.store.url} failed "
               f"({type(e).__name__}: {e}); the local checkpoint is committed and intact, and the next save "
               f"retries the copy")

