"""The checkpoint directory: commit, `latest`, retention and cleanup of torn leftovers.

The manifest rename is the only commit point.  Retention deletes manifests
first and data files only when no remaining manifest references them, so a
kill at any moment leaves every retained composite whole; what it leaves
behind is unreferenced and removed by :func:`cleanup` on the next open.
"""
from __future__ import annotations

import json
import logging
import os
import signal
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from . import format as fmt
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

log = logging.getLogger("layerckpt")


def ensure_layout(root: str) -> None:
    for sub in (fmt.DATA_DIR, fmt.MANIFEST_DIR):
        os.makedirs(os.path.join(root, sub), exist_ok=True)


def commit(root: str, manifest: Dict[str, Any]) -> str:
    """Write the manifest atomically, then point `latest` at it.  Returns the manifest path."""
    name = fmt.manifest_name(manifest["step"])
    path = os.path.join(root, fmt.MANIFEST_DIR, name)
    fmt.write_atomic(path, json.dumps(manifest, separators=(",", ":"), allow_nan=True).encode())
    fmt.write_atomic(os.path.join(root, fmt.LATEST), (name + "\n").encode())
    return path


def read_all(root: str) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
    """All committed manifests that parse, by name, and the names of those that do not."""
    good, bad = {}, []
    for _, name in fmt.list_manifests(root):
        try:
            good[name] = fmt.load_manifest(os.path.join(root, fmt.MANIFEST_DIR, name))
        except CheckpointError:
            bad.append(name)
    return good, bad


def _recency(manifests: Dict[str, Dict[str, Any]]):
    """Commit order (seq), then step: the newest committed is not always the highest step."""
    return lambda n: (manifests[n].get("seq", 0), manifests[n]["step"])


def newest(manifests: Dict[str, Dict[str, Any]]) -> Optional[str]:
    return max(manifests, key=_recency(manifests), default=None)


def resolve(root: str, step: Optional[int] = None) -> str:
    """Path of the manifest to restore: the one for `step`, else the newest committed."""
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint directory {root} does not exist")
    if not os.path.isdir(os.path.join(root, fmt.MANIFEST_DIR)):
        raise CheckpointNotFoundError(
            f"{root} is not a layerckpt directory (no {fmt.MANIFEST_DIR}/); point at the dirpath given to Checkpointer"
        )
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        path = os.path.join(root, fmt.MANIFEST_DIR, fmt.manifest_name(step))
        if not os.path.exists(path):
            have = [s for s, _ in fmt.list_manifests(root)]
            raise CheckpointNotFoundError(f"no committed checkpoint for step {step} in {root}; committed steps: {have}")
        return path
    try:
        with open(os.path.join(root, fmt.LATEST), "r", encoding="utf-8") as f:
            name = f.read().strip()
        path = fmt.safe_join(root, fmt.MANIFEST_DIR, name, f"{root}/latest")
        if os.path.exists(path):
            return path
    except (FileNotFoundError, UnicodeDecodeError, CheckpointCorruptError):
        pass
    # `latest` missing or stale: the newest manifest that parses
    good, bad = read_all(root)
    name = newest(good)
    if name is None:
        hint = f" ({len(bad)} damaged manifest(s): {', '.join(bad)})" if bad else ""
        raise CheckpointNotFoundError(f"no committed checkpoint in {root}{hint}")
    return os.path.join(root, fmt.MANIFEST_DIR, name)


def is_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a layerckpt checkpoint directory or one of its manifests."""
    try:
        locate(path)
        return True
    except CheckpointError:
        return False


def locate(path: Union[str, os.PathLike]) -> Tuple[str, Optional[int]]:
    """(checkpoint directory, step or None for the newest) named by a directory or a manifest path."""
    p = os.path.abspath(os.fspath(path))
    if os.path.isfile(p):
        parent = os.path.dirname(p)
        step = fmt.manifest_step(os.path.basename(p))
        if step is None or os.path.basename(parent) != fmt.MANIFEST_DIR:
            raise CheckpointNotFoundError(f"{p} is a file but not a layerckpt manifest ({fmt.MANIFEST_DIR}/step-N.json)")
        return os.path.dirname(parent), step
    if os.path.isdir(p) and os.path.isdir(os.path.join(p, fmt.MANIFEST_DIR)):
        return p, None
    if os.path.isdir(p):
        raise CheckpointNotFoundError(
            f"{p} is a directory but not a layerckpt checkpoint (it has no {fmt.MANIFEST_DIR}/ folder); "
            f"pass the dirpath layerckpt saved into, or one of its {fmt.MANIFEST_DIR}/step-N.json")
    raise CheckpointNotFoundError(f"checkpoint {p} does not exist")


def referenced_files(manifests: Dict[str, Dict[str, Any]]) -> Set[str]:
    return {f for m in manifests.values() for f in m["files"]}


def cleanup(root: str) -> List[str]:
    """Remove torn leftovers: temp files and data no committed manifest references."""
    removed = []
    for sub in ("", fmt.MANIFEST_DIR, fmt.DATA_DIR):
        d = os.path.join(root, sub)
        for n in os.listdir(d) if os.path.isdir(d) else ():
            if n.endswith(".tmp"):
                _unlink(os.path.join(d, n), removed)
    good, bad = read_all(root)
    if bad:  # we cannot know what a damaged manifest references: keep every data file
        log.warning("layerckpt: damaged manifest(s) %s in %s; no data file is cleaned up", bad, root)
        return removed
    keep = referenced_files(good)
    d = os.path.join(root, fmt.DATA_DIR)
    for n in os.listdir(d) if os.path.isdir(d) else ():
        if fmt.is_data_name(n) and n not in keep:
            _unlink(os.path.join(d, n), removed)
    return removed


def retain(root: str, keep_last: int) -> List[str]:
    """Keep the keep_last newest composites; delete the rest, then unreferenced data."""
    if keep_last <= 0:
        return []
    good, bad = read_all(root)
    order = sorted(good, key=_recency(good), reverse=True)
    return drop(root, good, bad, order[keep_last:])


def drop(root: str, good: Dict[str, Dict[str, Any]], bad: List[str], names: List[str]) -> List[str]:
    """Delete the committed manifests ``names`` (``good``/``bad``: what :func:`read_all` returned), then
    the data files only they referenced.  Manifests go first and are made durable before any data file
    goes, so a kill at any moment leaves every kept composite whole.  With a damaged manifest present
    no data file is deleted (what it references is unknown)."""
    removed: List[str] = []
    for n in names:
        _unlink(os.path.join(root, fmt.MANIFEST_DIR, n), removed)
    if names:
        fmt.fsync_dir(os.path.join(root, fmt.MANIFEST_DIR))
        if os.environ.get("LAYERCKPT_FAULT") == "kill-in-retain":  # fault injection for the tests
            os.kill(os.getpid(), signal.SIGKILL)
    if bad:
        return removed
    gone = set(names)
    keep = referenced_files({n: m for n, m in good.items() if n not in gone})
    for f in sorted(referenced_files({n: good[n] for n in names}) - keep):
        _unlink(os.path.join(root, fmt.DATA_DIR, f), removed)
    return removed


def _unlink(path: str, removed: List[str]) -> None:
    try:
        os.unlink(path)
        removed.append(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # one failed delete must not stop the rest of the cleanup
        log.warning("layerckpt: could not delete %s: %s", path, e)
