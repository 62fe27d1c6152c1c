"""Where a manifest's tensors lie in their files, and checksums sealed to their place.

Regions.  Each tensor entry owns one region of its data file: ``[offset, offset + nbytes)`` for raw bytes, the
span of its blocks for an encoded tensor (``_encode``).  The writers lay tensors out one after another, and an
encoded tensor's blocks in the order of its bytes, each after the one before (``_encwrite`` writes the encoded
buffers in image order, ``_transcode`` a tensor's blocks one after another); blocks are cut where the file
image's ``BLOCK`` and staging-chunk boundaries fall, multiples of ``ALIGN``.  So the manifest's validator
(``_validate``, ``Manifest.from_dict``) refuses, before anything is read or allocated:

- two tensors of one file whose regions overlap (each stored byte belongs to one tensor);
- a tensor whose blocks (or its reference's) go back in the file or overlap the one before;
- more blocks than ``nbytes // ALIGN + 2``, the most its bytes are cut into.

Decoding is then bounded by what the tensor needs: its blocks cover its bytes once, in order, each read once
from the region the tensor owns; a manifest cannot make one stored block decode many times.

Seals.  A CRC over a tensor's bytes does not say which tensor they are, nor which version: another tensor's
blocks and CRC copied onto an entry, two boxes swapped with their CRCs, an older version's entry (or a delta of
"unchanged" blocks against an older version, with that version's CRC) under a newer step, or an older file's
entry relabelled with the newer step, would each read back as sound.  A tensor entry written by this layerckpt
records its ``crc`` sealed to its key and its step: bits 32 and 33 (``SEALED | STEPPED``) set, and in the low 32
bits the CRC of its raw bytes continued over the entry's key (which names the tensor, and the row block or box
of a tensor stored in pieces) and then over the step of the save that wrote it (8 bytes, little-endian; the
step last, at a fixed width: no two (key, step) pairs give the same message), in the manifest's checksum.  That step is
the one the manifest records for the data file the entry lives in (``files[e.file].step``): the commit
(``_commit.merge``) seals every entry of the save's files with the save's step, the step it records for them;
every later composite carries the entry with its file (a layer kept from an older step, a delta's reference)
and every tier copy lists the file with that step (``_tiers.renamed``, ``_transcode.apply``: an encoded copy's
parts keep the step of the file they copy).  A reader takes the CRC of the bytes it read (decoded) as before
and continues it over the key of the entry it reads them for and the step recorded for its file: bytes that
belong to another tensor, another piece of the same tensor or another version, or a file given another step
than the one it was written at, do not match.  So a tier never serves a file from one of another step that
holds the same bytes: their entries' seals differ (``_tiers.place`` compares them).

Entries written before steps were sealed keep the seal they were written with and read as before: bit 32 alone
is a seal to the key only (format version 4), no bit a plain CRC (version 3 or less); composites carry them
unchanged.  Clearing a bit does not help an edit: the value is then compared as the weaker seal (or as a plain
CRC), which it is not.  A reader that predates step seals reports a step-sealed entry as a checksum mismatch
(the manifest's version, 5, tells it to upgrade first).  The validator holds each data file to one kind of
seal: a file one of whose entries is sealed to its step was written by a layerckpt that seals them all so.
The references to tensors in the optimizer state, RNG and extra are bound to their place by the validator,
each naming the key the writer gives its place (``_validate._check_places``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ..io._units import ALIGN
from ..errors import CheckpointCorruptError

SEALED = 1 << 32  # set in a tensor entry's crc: the CRC is sealed to the entry's key
STEPPED = 1 << 33  # set (with SEALED) in a tensor entry's crc: sealed to its key and to its file's step too
CRC_MAX = (STEPPED << 1) - 1  # a crc is a 32-bit CRC, plain or sealed: nothing above bit 33

Check = Callable[..., int]  # check(buffer, seed) -> CRC, the manifest's checksum (``_backend.checksum_function``)


def seal(check: Check, key: str, crc: int, step: Optional[int] = None) -> int:
    """The crc a tensor entry records for raw bytes whose CRC is ``crc``: sealed to its key and, where ``step`` is
    given (every entry written since format version 5: the step recorded for the entry's file), to that step."""
    sealed = check(key.encode("utf-8", "surrogatepass"), crc) & 0xFFFFFFFF
    if step is None:  # format version 4's seal (to the key only): what such entries hold, checked as before
        return SEALED | sealed
    return SEALED | STEPPED | (check(step.to_bytes(8, "little"), sealed) & 0xFFFFFFFF)


def pretrained_seal(check: Check, key: str, name: str, fp: List[int], step: Optional[int] = None,
                    dtype: str = "", shape: Optional[List[int]] = None) -> int:
    """The seal of a tensor held by reference to the pretrained files (``PretrainedEntry.seal``): the manifest's
    checksum over the entry's key, the pretrained tensor's name, its fingerprint and (entries written since format
    version 8) the step its layer records, its dtype and shape, so that an entry copied onto another key (which
    would hand that key another tensor's bytes, each sound under its own fingerprint), from a composite where its
    layer was of another step (the pretrained bytes restored where the layer has trained since), or given another
    dtype or shape of as many bytes, is refused."""
    msg = f"{key}\0{name}\0{','.join(map(str, fp))}"
    if step is not None:
        msg += f"\0{step}\0{dtype}\0{','.join(map(str, shape or []))}"
    return check(msg.encode("utf-8", "surrogatepass"), 0) & 0xFFFFFFFF


def sealed_ok(check: Check, recorded: int, key: str, crc: int, step: int) -> bool:
    """Whether bytes whose CRC is ``crc``, read for the entry ``key`` in a file of ``step``, match its ``recorded``
    crc (sealed to key and step, to the key only, or plain: as the entry was written)."""
    if recorded & STEPPED:
        return recorded == seal(check, key, crc, step)
    if recorded & SEALED:
        return recorded == seal(check, key, crc)
    return recorded == crc


def check_seal_kinds(tensors: Dict[str, Any], path: str) -> None:
    """Every entry of a data file one of whose entries is sealed to its step is sealed so too: the writer that
    seals steps seals every entry of the files it writes, and a file is written by one save (an entry without
    the step's seal there was taken from a file written before step seals, or its crc was edited)."""
    stepped = {e.file for e in tensors.values() if e.crc & STEPPED}
    for key, e in tensors.items():
        if e.file in stepped and not e.crc & STEPPED:
            raise _corrupt(path, f"tensor {key!r} in file {e.file!r} has a checksum not sealed to its step, "
                                 f"where the file's other entries are: one file, one writer", key)


def max_blocks(nbytes: int) -> int:
    """The most blocks a tensor of ``nbytes`` raw bytes is cut into (cuts fall on multiples of ``ALIGN``)."""
    return nbytes // ALIGN + 2


def check_block_order(key: str, blocks: List[List[int]], fname: str, path: str, what: str = "") -> None:
    """A tensor's blocks ([file offset, length, raw length, mode], already checked one by one, at most
    :func:`max_blocks`) in file order, none overlapping the one before."""
    end = 0
    for b in blocks:
        if b[0] < end:
            raise _corrupt(path, f"tensor {key!r}{what} has a block at bytes {b[0]}..{b[0] + b[1]} of {fname!r} "
                                 f"before the end of the one ahead of it ({end}): a tensor's blocks lie in file "
                                 f"order, each stored byte read once", key)
        end = b[0] + b[1]


def region(e: Any) -> Tuple[int, int]:
    """The bytes [start, end) of its file a tensor entry owns (raw bytes, or the span of its stored blocks)."""
    if e.enc is None:
        return e.offset, e.offset + e.nbytes
    stored = [b for b in e.enc["blocks"] if b[1]]
    if not stored:
        return 0, 0
    return stored[0][0], stored[-1][0] + stored[-1][1]  # in file order: checked before


def check_regions(tensors: Dict[str, Any], path: str) -> None:
    """No two tensors of one file own overlapping bytes."""
    by_file: Dict[str, List[Tuple[int, int, str]]] = {}
    for key, e in tensors.items():
        a, z = region(e)
        if z > a:
            by_file.setdefault(e.file, []).append((a, z, key))
    for fname, spans in by_file.items():
        spans.sort()
        reach: Optional[Tuple[int, int, str]] = None
        for span in spans:
            if reach is not None and span[0] < reach[1]:
                raise _corrupt(path, f"tensor {span[2]!r} (bytes {span[0]}..{span[1]} of file {fname!r}) overlaps "
                                     f"tensor {reach[2]!r} (bytes {reach[0]}..{reach[1]}): each stored byte "
                                     f"belongs to one tensor", span[2])
            if reach is None or span[1] > reach[1]:
                reach = span


def check_own_files(step: int, files: Dict[str, Any], tensors: Dict[str, Any], path: str) -> None:
    """The data files a save wrote hold its tensors and nothing else: a raw file image is a header, then its
    tensors back to back to the end (``_layout``), and the save's manifest lists every one of them.  So in a file
    of the manifest's own step (the only one of its step and rank: a second save at one step may carry layers
    from the first's file), written raw, the entries' regions start on an ``ALIGN`` boundary and run without a
    gap to the file's end.  A gap is a tensor the manifest no longer lists there: a layer's entries replaced by an
    older step's (with the layer's record) would restore the older bytes as if the save had not written it."""
    own: Dict[Tuple[int, int], List[str]] = {}
    for name, f in files.items():
        if f.step == step:
            own.setdefault((f.step, f.rank), []).append(name)
    only = {names[0] for names in own.values() if len(names) == 1}
    spans: Dict[str, List[Tuple[int, int, str]]] = {name: [] for name in only}
    for key, e in tensors.items():
        if e.file in spans:
            if e.enc is not None:  # an encoded file's blocks are laid out by the encoder: not checked here
                spans.pop(e.file)
            elif e.nbytes:
                spans[e.file].append((e.offset, e.offset + e.nbytes, key))
    for name, got in spans.items():
        gap = _gap(sorted(got), files[name].size)
        if gap is not None:
            raise _corrupt(path, f"file {name!r}, written by this save, holds {gap} that no tensor entry accounts "
                                 f"for: the save wrote a tensor there that the manifest no longer lists (its entry "
                                 f"replaced by another step's?)", None)


def _gap(spans: List[Tuple[int, int, str]], size: int) -> Optional[str]:
    """The first bytes of a raw file image (its header, then ``spans`` back to back to ``size``) no span covers."""
    if not spans:
        return None
    if spans[0][0] % ALIGN:  # the header ends on an ALIGN boundary, the first tensor right after it
        return f"bytes before {spans[0][0]}"
    at = spans[0][0]
    for a, z, _ in spans:
        if a != at:
            return f"bytes {at}..{a}"
        at = z
    return None if at == size else f"bytes {at}..{size}"


def _corrupt(path: str, msg: str, tensor: Optional[str]) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"manifest {path}: {msg}; the manifest was edited or damaged: restore another "
                                  f"step", path=path, tensor=tensor)
