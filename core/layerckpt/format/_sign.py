"""Signed checkpoints: a keyed digest over each manifest and a cryptographic digest of each data file.

The seals (``_places``) are CRCs: they catch damage, and bytes or entries moved to a place they do not belong, but
whoever can write the store can recompute them, so a forged lossy scale, a forged pretrained reference or an older
entry with a recomputed CRC reads back as sound.  With a key (``Config.sign_key``, else the environment's
``LAYERCKPT_SIGN_KEY``; never written to the store) a store is signed:

- each data file's bytes are digested with SHA-256 as they are written (``Hasher``: each staged buffer hashed on
  worker threads while its write is in flight, off the training's path; a file written encoded, whose bytes are
  not the staged ones, is read back once it is durable), in consecutive parts; ``FileEntry.digest`` records the
  parts as ``[[bytes, hex digest], ...]``, and every later composite carries it with its file;
- the manifest records the store's identity (``Manifest.store``) and ends with ``"signature"``: HMAC-SHA256 under
  the key over every byte before it (``sign``).  Every file entry, tensor entry, seal, pretrained reference and
  digest is under it.

A restore or ``verify`` with the key refuses a manifest that is not signed by it (unsigned, another key, any byte
edited), one signed for another store (copied from another run's directory: its identity differs), and a data file
whose bytes do not match the digest the signed manifest records (swapped, rolled back, edited with its CRCs
recomputed).  Without a key, a signed store reads as any other.  An SHA-256 part is 64 hex characters per staged
buffer (``Config.chunk_bytes``): a few per GB.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, List, Optional, Tuple

from ..errors import CheckpointCorruptError, ConfigError
from ._json import open_regular

ENV = "LAYERCKPT_SIGN_KEY"
MIN_KEY = 16  # characters: an HMAC key shorter than this is guessable
PART = 64 << 20  # the parts a file read back is digested in
_DOMAIN = b"layerckpt-manifest-signature-1\0"
_TAIL = re.compile(rb',"signature":"([0-9a-f]{64})"\}\s*$')


def key_of(config: Any = None) -> Optional[bytes]:
    """The signing key: ``config.sign_key``, else ``$LAYERCKPT_SIGN_KEY``, else None (unsigned)."""
    given = getattr(config, "sign_key", None) if config is not None else None
    where = "Config.sign_key"
    if given is None:
        given, where = os.environ.get(ENV) or None, ENV
    if given is None:
        return None
    return check_key(given, where)


def check_key(key: Any, where: str = "Config.sign_key") -> bytes:
    if not isinstance(key, (str, bytes)) or len(key) < MIN_KEY:
        raise ConfigError(f"{where} must be a secret of at least {MIN_KEY} characters (a string or bytes), got "
                          f"{'one of ' + str(len(key)) + ' characters' if isinstance(key, (str, bytes)) else type(key).__name__}: "
                          f"a short key is guessable; generate one with python -c 'import secrets; "
                          f"print(secrets.token_hex(32))'")
    return key.encode() if isinstance(key, str) else bytes(key)


def _mac(body: bytes, key: bytes) -> str:
    return hmac.new(key, _DOMAIN + body, hashlib.sha256).hexdigest()


def sign(body: bytes, key: bytes) -> bytes:
    """``body``, a manifest's JSON object, with ``"signature"`` added last: the HMAC of every byte before it."""
    body = body.rstrip()
    if not body.endswith(b"}"):
        raise ValueError("a manifest is a JSON object")
    head = body[:-1]
    return head + b',"signature":"' + _mac(head + b"}", key).encode() + b'"}'


def check(raw: bytes, key: bytes, path: str) -> None:
    """Refuse the manifest ``raw`` (read from ``path``) unless it is signed by ``key``."""
    found = _TAIL.search(raw)
    if found is None:
        raise CheckpointCorruptError(
            f"manifest {path} is not signed, and a signing key is set (Config.sign_key or ${ENV}): a store signed "
            f"with it records a signature in every manifest; this one was written without the key, or edited. "
            f"Restore another step, or read without the key if the store was never signed", path=path)
    body = raw[:found.start()] + b"}"
    if not hmac.compare_digest(_mac(body, key), found.group(1).decode()):
        raise CheckpointCorruptError(
            f"manifest {path} is not signed by the key given (Config.sign_key or ${ENV}): it was signed with "
            f"another key, or edited since it was signed; restore another step", path=path)


def check_store(recorded: Optional[str], identity: Optional[str], path: str) -> None:
    """A signed manifest belongs to the store it is read from: its recorded identity is the store's, where the
    store has one (a downloaded or replicated copy may not say)."""
    if identity is not None and recorded != identity:
        raise CheckpointCorruptError(
            f"manifest {path} is signed for the store {recorded or '(none)'}, but it lies in the store {identity}: "
            f"it was copied from another run's directory; restore another step", path=path)


class Hasher:
    """SHA-256 digests of the parts of one file image as its staged buffers are written: each buffer hashed on
    a worker thread (hashlib releases the GIL) while its write is in flight; the buffer is held until both are
    done (``WriteLoop``).  :meth:`parts` gives the file's digest where the buffers cover it exactly."""

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool = pool
        self._parts: List[Tuple[int, int, "Future[str]"]] = []

    def submit(self, base: int, view: memoryview, fill: int) -> "Future[str]":
        fut = self._pool.submit(_hex, view[:fill])
        self._parts.append((base, fill, fut))
        return fut

    def parts(self, size: int) -> Optional[List[List[Any]]]:
        """``[[bytes, hex], ...]`` covering ``[0, size)`` in order, else None (the buffers did not cover it)."""
        at, out = 0, []
        for base, n, fut in sorted(self._parts, key=lambda p: p[0]):
            hexd = fut.result()
            if base != at or n <= 0 or at + n > size:  # a gap, an empty buffer or a tail past the end
                return None
            out.append([n, hexd])
            at += n
        return out if at == size else None


def _hex(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def _next_part(f, n: int) -> Tuple[str, int]:
    """(the SHA-256 of the next ``n`` bytes of the open file ``f``, how many it held: fewer at its end)."""
    h, got = hashlib.sha256(), 0
    while got < n:
        b = f.read(min(8 << 20, n - got))
        if not b:
            break
        h.update(b)
        got += len(b)
    return h.hexdigest(), got


def file_parts(path: str, size: int, part: int = PART) -> List[List[Any]]:
    """The digest of the file at ``path`` (its first ``size`` bytes) read back, in parts of ``part`` bytes."""
    out: List[List[Any]] = []
    with open(path, "rb", buffering=0) as f:
        for at in range(0, size, part):
            n = min(part, size - at)
            hexd, got = _next_part(f, n)
            if got < n:
                raise CheckpointCorruptError(f"data file {path} is shorter than the {size} bytes its manifest "
                                             f"records", path=path)
            out.append([n, hexd])
    return out


def check_file(path: str, size: int, parts: Optional[List[List[Any]]], manifest: str) -> None:
    """Refuse the data file at ``path`` unless its bytes are those the signed manifest's digest records."""
    if parts is None:
        raise CheckpointCorruptError(
            f"manifest {manifest} records no digest of its data file {os.path.basename(path)}, and a signing key is "
            f"set: a signed store digests every file it writes; restore another step", path=manifest)
    fd, st = open_regular(path, "data file", follow=False)
    with os.fdopen(fd, "rb", buffering=0) as f:
        if st.st_size != size:
            raise CheckpointCorruptError(f"data file {path} holds {st.st_size} bytes, not the {size} its signed "
                                         f"manifest {manifest} records: it was replaced", path=path)
        at = 0
        for n, want in parts:
            if not hmac.compare_digest(_next_part(f, n)[0], want):
                raise CheckpointCorruptError(
                    f"data file {path}: bytes {at}..{at + n} do not match the digest its signed manifest {manifest} "
                    f"records: the file was replaced or edited since it was written; restore another step",
                    path=path)
            at += n


def load_signed(root: str, mpath: str, key: bytes, files: bool = True):
    """The manifest at ``mpath`` in the store ``root``, refused unless signed by ``key`` for this store, and
    (``files``) unless each of its data files the store holds has the bytes its digest records (read on a few
    threads; a file the store lacks is refused by the read that needs it)."""
    from ._json import loads_strict, read_regular
    from ._manifest import Manifest
    from ._store import DATA_DIR, store_id

    raw = read_regular(mpath, "manifest", follow=False)
    check(raw, key, mpath)
    m = Manifest.from_dict(loads_strict(raw, mpath), mpath)  # the bytes the signature was checked over
    try:
        identity = store_id(root)
    except CheckpointCorruptError:
        identity = None
    check_store(m.store, identity, mpath)
    if files:
        held = [(os.path.join(root, DATA_DIR, f), e) for f, e in m.files.items()
                if os.path.lexists(os.path.join(root, DATA_DIR, f))]
        with ThreadPoolExecutor(min(4, max(1, len(held))), thread_name_prefix="layerckpt-digest") as ex:
            for fut in [ex.submit(check_file, p, e.size, e.digest, mpath) for p, e in held]:
                fut.result()
    return m
