"""`layerckpt bench --only tiers`: restore from the memory tier against the disk, and the remote tier
against a plain fsspec upload (and download) of a torch.save file of the same state.

Every restore reads into a fresh model and optimizer, as after a crash, and
every read of a file starts cold: the disk's files, and a ``file://`` remote's
(layerckpt's and the plain baseline's alike), are dropped from the page cache
first; the memory tier is memory.  The remote is any fsspec URL (``--remote``);
by default a folder beside the checkpoint (``file://``), which measures the
tier's own cost rather than a network.
"""
from __future__ import annotations

import os
import shutil
import statistics
import time
import uuid
from typing import Any, Dict, Mapping, Optional

import torch

from ..tiers._memtier import memory_path
from ..config import Config
from .cases import _timed, build_state, drop_cache, perturb


def bench_tiers(root: str, model, opt, cfg: Config, preset: str, reps: int = 2, remote: Optional[str] = None,
                remote_options: Optional[Mapping[str, Any]] = None, cap: Optional[int] = 100_000_000
                ) -> Dict[str, Any]:
    from ..checkpointer import Checkpointer
    from ..restore import restore

    d = os.path.join(root, "tiers")
    url = (remote.rstrip("/") + "/" if remote else "file://" + os.path.join(root, "remote") + "/") + uuid.uuid4().hex[:8]
    options = dict(remote_options or {})
    out: Dict[str, Any] = {"remote": url.split("://", 1)[0] + "://" if remote else "file:// (the same disk)",
                           "cap": cap, "cold_reads": True}
    full = cfg.replace(threshold=0.0, keep_last=1, memory_tier=True, remote=url, remote_options=options)
    durable, remote_durable, copies = [], [], []
    with Checkpointer(d, model, opt, config=full) as ck:
        ck.save(0).wait()
        ck.wait()  # the first save allocates the pool; not timed
        for i in range(reps):
            with torch.no_grad():  # new bytes: a tier that holds them already would copy nothing
                for q in model.parameters():
                    q.add_(1e-3)
            t0 = time.perf_counter()
            p = ck.save(i + 1).wait()
            durable.append(p.durable_s)
            ck.wait()  # the memory and remote copies
            remote_durable.append(time.perf_counter() - t0)
        copies = [t.files_copied for t in ck._tiers.tiers]
    out.update(durable_s=min(durable), all_tiers_durable_s=min(remote_durable), files_copied=copies)

    def fresh():
        return build_state(preset, seed=1, step=False)

    def same(m2) -> bool:
        return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))

    local = cfg.replace(remote=None, remote_options={})  # memory vs disk: no remote to ask
    mem, disk, ok = [], [], True
    for _ in range(reps):
        m2, o2 = fresh()
        mem.append(_timed(lambda: restore(d, m2, o2, config=local)))
        ok = ok and same(m2)
    shutil.move(memory_path(d), memory_path(d) + ".aside")  # as after a node restart
    try:
        for _ in range(reps):
            m2, o2 = fresh()
            drop_cache(d)
            disk.append(_timed(lambda: restore(d, m2, o2, config=local)))
            ok = ok and same(m2)
    finally:
        shutil.rmtree(memory_path(d) + ".aside", ignore_errors=True)
    rem = []
    for _ in range(reps):
        m2, o2 = fresh()
        _cold(url)
        rem.append(_timed(lambda: restore(url, m2, o2, config=full)))
        ok = ok and same(m2)
    out.update(restore_memory_s=min(mem), restore_disk_s=min(disk), restore_remote_s=min(rem),
               restore_memory_median_s=statistics.median(mem), restore_disk_median_s=statistics.median(disk),
               restore_bit_exact=ok)
    out.update(_plain(root, model, opt, url, options, reps, preset))
    if cap:
        out["capped"] = {enc: _capped(root, model, opt, cfg.replace(encoding=enc), url + "-" + enc, options, cap,
                                      reps + 2, preset) for enc in (cfg.encoding, "off")}
    return out


def _capped(root: str, model, opt, cfg: Config, url: str, options: Dict[str, Any], cap: int, saves: int,
            preset: str) -> Dict[str, Any]:
    """Full saves of a fine-tune (each after an AdamW-like step of every tensor) to a remote capped at ``cap``
    bytes a second: per save, the local commit, how long the remote copy trails it, and the bytes uploaded
    against the raw bytes of the save's file."""
    from ..checkpointer import Checkpointer
    from ..restore import restore

    d = os.path.join(root, "capped-" + cfg.encoding)
    conf = cfg.replace(threshold=0.0, keep_last=2, remote=url, remote_options=options, remote_bandwidth=cap)
    local, trail, sent, raw = [], [], [], []
    with Checkpointer(d, model, opt, config=conf) as ck:
        ck.save(0).wait()
        ck.wait()  # the first save allocates the pool and is a base
        tier = ck._tiers.tiers[-1]
        for i in range(saves):
            perturb(model, opt, seed=100 + i)
            before = tier.bytes_sent
            t0 = time.perf_counter()
            p = ck.save(i + 1).wait()
            committed = t0 + p.durable_s
            ck.wait()
            trail.append(time.perf_counter() - committed)
            local.append(p.durable_s)
            sent.append(tier.bytes_sent - before)
            raw.append(p.bytes_written)
    m2, o2 = build_state(preset, seed=1, step=False)
    _cold(url)
    restore(url, m2, o2, config=conf)
    ok = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
    shutil.rmtree(d, ignore_errors=True)
    last = max(1, saves // 2)  # the cost model decides on what the first saves measured: the later ones count
    return {"local_s": local, "trail_s": trail, "sent": sent, "raw": raw, "restore_bit_exact": ok,
            "trail_median_s": statistics.median(trail[-last:]), "local_median_s": statistics.median(local[-last:]),
            "sent_over_raw": sum(sent[-last:]) / max(1, sum(raw[-last:]))}


def _plain(root: str, model, opt, url: str, options: Dict[str, Any], reps: int, preset: str) -> Dict[str, Any]:
    """The baseline: torch.save to a local file (fsync), then one fsspec put; back: get, torch.load."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(url + "-plain", **options)
    if type(fs).__name__ == "LocalFileSystem":
        fs.makedirs(base, exist_ok=True)
    f = os.path.join(root, "plain.pt")
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    ups, downs = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        with open(f, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fs.put_file(f, base + "/plain.pt")
        ups.append(time.perf_counter() - t0)
        os.unlink(f)
        m2, o2 = build_state(preset, seed=1, step=False)
        _cold(url + "-plain")
        t0 = time.perf_counter()
        fs.get_file(base + "/plain.pt", f)
        got = torch.load(f, weights_only=True)
        m2.load_state_dict(got["model"])
        o2.load_state_dict(got["optimizer"])
        downs.append(time.perf_counter() - t0)
        os.unlink(f)
    fs.rm(base, recursive=True)
    return {"plain_upload_s": min(ups), "plain_restore_s": min(downs)}


def _cold(url: str) -> None:
    """A ``file://`` remote read cold, as the disk is (a network remote has no page cache of ours)."""
    if url.startswith("file://") and os.path.exists(url[len("file://"):]):
        drop_cache(url[len("file://"):])


def format_tiers(t: Dict[str, Any], gb: float) -> str:
    """The tiers' lines of ``layerckpt bench``'s table; "reads all cold" only where the run records it (runs
    before the file:// remote was read cold do not)."""
    capped = []
    for enc, c in (t.get("capped") or {}).items():
        capped.append(f"  remote capped at {t.get('cap', 0) / 1e6:.0f} MB/s, Config.encoding {enc!r}: local commit "
                      f"{c['local_median_s']:.3f}s, the remote copy trails it by {c['trail_median_s']:.3f}s, uploaded "
                      f"{c['sent_over_raw']:.3f}x the raw bytes ({1 / max(c['sent_over_raw'], 1e-9):.2f}x fewer); "
                      f"bit-exact from the remote: {c['restore_bit_exact']}")
    return "\n".join([
        f"tiers (full saves, {gb:.2f} GB; remote {t['remote']}"
        f"{'; disk and file:// reads all cold' if t.get('cold_reads') else ''}):",
        f"  save() to durable: local {t['durable_s']:.3f}s; every tier (memory + remote) {t['all_tiers_durable_s']:.3f}s; "
        f"plain torch.save + fsync + fsspec put {t['plain_upload_s']:.3f}s",
        f"  restore: memory tier {t['restore_memory_s']:.3f}s, disk {t['restore_disk_s']:.3f}s "
        f"({t['restore_disk_s'] / t['restore_memory_s']:.1f}x), remote {t['restore_remote_s']:.3f}s; "
        f"plain fsspec get + torch.load {t['plain_restore_s']:.3f}s; bit-exact: {t['restore_bit_exact']}",
    ] + (["  fine-tune (an AdamW-like step of every tensor between full saves), medians of the later saves "
          "(the first ones measure for the cost model):"] + capped if capped else []))
