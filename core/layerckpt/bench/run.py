"""`layerckpt bench`: layerckpt against torch.save, safetensors and DCP, beside the machine's own limits.

Every figure comes from one run on one state (GPT-2 small + AdamW by default),
so the ratios compare like with like.  Files are dropped from the page cache
before each restore so that every reader starts cold.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional

from ..io._backend import CHECKSUM, uring_available
from .cases import (DiskLimits, bench_dcp, bench_layerckpt, bench_overhead, bench_safetensors, bench_selective,
                    bench_torch_save, build_state, checksum_rate, compression_rate, flat_tensors, memcpy_time,
                    state_bytes)
from ..config import Config
from .machine import machine


def run(preset: str = "gpt2-small", dirpath: Optional[str] = None, reps: int = 3,
        config: Optional[Config] = None, only: Optional[List[str]] = None, remote: Optional[str] = None,
        remote_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    cfg = config or Config()
    if dirpath:
        os.makedirs(dirpath, exist_ok=True)
    root = tempfile.mkdtemp(prefix="layerckpt-bench-", dir=dirpath)
    try:
        model, opt = build_state(preset)
        nbytes = state_bytes(model, opt)
        tensors = list(flat_tensors(model, opt).values())
        res: Dict[str, Any] = {
            "machine": {**machine(), "dir": root, "io_uring": uring_available() or "yes"},
            "preset": preset, "state_bytes": nbytes, "checksum": CHECKSUM, "reps": reps,
            "config": {"chunk_bytes": cfg.chunk_bytes, "queue_depth": cfg.queue_depth},
        }
        res["memcpy_s"] = memcpy_time(tensors)
        res["checksum_gbps"] = checksum_rate()
        res["compression"] = compression_rate(tensors)
        disk = DiskLimits(os.path.join(root, "limit.bin"), nbytes, cfg.chunk_bytes, cfg.queue_depth)
        want = set(only or ["layerckpt", "selective", "torch.save", "safetensors", "dcp", "tiers"])
        runs = {}
        if "layerckpt" in want:
            runs["layerckpt"] = bench_layerckpt(root, model, opt, cfg, reps, disk, preset)
            # the same saves with each encoding forced: every tensor delta-encoded, and none
            for enc in ("delta", "off"):
                if cfg.encoding != enc:
                    runs[f"layerckpt {enc}"] = bench_layerckpt(root, model, opt, cfg.replace(encoding=enc), reps,
                                                               disk, preset)
        else:
            disk.write()
            disk.read(fresh=False)
            disk.read(fresh=True)
        disk.close()
        res["disk"] = {"write_s": min(disk.writes), "read_s": min(disk.reads), "read_fresh_s": min(disk.fresh_reads),
                       "write_all_s": disk.writes, "read_all_s": disk.reads, "read_fresh_all_s": disk.fresh_reads,
                       "overwrite_s": min(disk.overwrites), "overwrite_all_s": disk.overwrites}
        if "selective" in want:
            res["selective"] = bench_selective(root, model, opt, cfg)
            res["overhead"] = bench_overhead(root, steps=80 if preset == "gpt2-small" else 8)
        if "torch.save" in want:
            runs["torch.save"] = bench_torch_save(root, model, opt, preset, reps)
        if "safetensors" in want:
            runs["safetensors"] = bench_safetensors(root, model, opt, preset, reps)
        if "dcp" in want:
            runs["dcp"] = bench_dcp(root, model, opt, preset, reps)
        if "tiers" in want:  # memory and remote tiers (bench/tiers.py)
            from .tiers import bench_tiers

            res["tiers"] = bench_tiers(root, model, opt, cfg, preset, max(2, reps - 1), remote, remote_options)
        res["runs"] = runs
        res["ratios"] = _ratios(res)
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _ratios(res: Dict[str, Any]) -> Dict[str, float]:
    r = res["runs"]
    lc = r.get("layerckpt")
    if not lc:
        return {}
    out = {
        "durable_vs_odirect_write": lc["durable_s"] / res["disk"]["write_s"],
        "durable_vs_odirect_overwrite": lc["durable_s"] / res["disk"].get("overwrite_s", res["disk"]["write_s"]),
        "stall_vs_memcpy": lc["stall_s"] / res["memcpy_s"],  # save()'s return only
        "blocked_vs_memcpy": lc["blocked_s"] / res["memcpy_s"],  # save() plus the next step's wait
        "restore_vs_odirect_read": lc["restore_s"] / res["disk"]["read_s"],
        "restore_vs_odirect_read_fresh_memory": lc["restore_s"] / res["disk"]["read_fresh_s"],
        "extra_mem_vs_state": lc["extra_mem_bytes"] / res["state_bytes"],
        "extra_mem_over_pool_vs_state": (lc["extra_mem_bytes"] - lc["pool_bytes"]) / res["state_bytes"],
    }
    for enc in ("delta", "off"):  # each forced encoding against the Config's
        other = r.get(f"layerckpt {enc}")
        if other:
            out[f"{enc}_bytes_over_ours"] = other["bytes"] / lc["bytes"]
            out[f"{enc}_durable_over_ours"] = other["durable_s"] / lc["durable_s"]
            out[f"{enc}_restore_over_ours"] = other["restore_s"] / lc["restore_s"]
    for name in ("torch.save", "safetensors", "dcp"):
        if name in r:
            out[f"{name}_durable_over_ours"] = r[name]["durable_s"] / lc["durable_s"]
            out[f"{name}_restore_over_ours"] = r[name]["restore_s"] / lc["restore_s"]
    if "dcp" in r and "async_durable_s" in r["dcp"]:
        out["dcp_async_durable_over_ours"] = r["dcp"]["async_durable_s"] / lc["durable_s"]
        out["dcp_async_stall_over_ours"] = r["dcp"]["async_stall_s"] / lc["stall_s"]
        out["dcp_async_stall_over_our_blocked"] = r["dcp"]["async_stall_s"] / lc["blocked_s"]
    return out


def format_table(res: Dict[str, Any]) -> str:
    gb = res["state_bytes"] / 1e9
    m = res["machine"]
    lines = [
        f"layerckpt bench: {res['preset']}, {gb:.2f} GB of state, on {m['cpu']} ({m['cores']} cores), "
        f"kernel {m['kernel']}, torch {m['torch']}",
        f"machine limits: memcpy {res['memcpy_s']:.3f}s ({gb / res['memcpy_s']:.1f} GB/s), "
        f"O_DIRECT write {res['disk']['write_s']:.3f}s ({gb / res['disk']['write_s']:.2f} GB/s)"
        + (f" (over a written file {res['disk']['overwrite_s']:.3f}s, {gb / res['disk']['overwrite_s']:.2f} GB/s)"
           if "overwrite_s" in res["disk"] else "") + ", "
        f"O_DIRECT read {res['disk']['read_s']:.3f}s ({gb / res['disk']['read_s']:.2f} GB/s; "
        f"into fresh memory {res['disk']['read_fresh_s']:.3f}s), "
        f"{res['checksum']} {res['checksum_gbps']:.1f} GB/s",
        "",
        f"medians of {res.get('reps', '?')} repeats each, [min-max]; save() s: the call to its return; blocked s: "
        f"what training waits for, save() plus the wait in the optimizer step right after it (layerckpt's lazy "
        f"staging; the others' saves are synchronous); durable s: the call to durable (fsync) and, for layerckpt, "
        f"committed; every save writes a new file or folder, deleting the previous one outside every timing"
        + ("; but layerckpt's: its saves write over the file a save two before retired (a spare), as in a run "
           "in progress (two untimed saves first)" if "overwrite_s" in res["disk"] else "") + "; "
        f"every restore reads cold (dropped from the page cache) into a fresh model",
        f"layerckpt: full saves (threshold 0.0), Config.encoding {res['runs'].get('layerckpt', {}).get('encoding')!r}"
        f"; 'layerckpt delta' and 'layerckpt off': the same with that encoding forced; before each save the state "
        f"takes one AdamW-like step "
        f"(random gradients, lr 1e-4, outside the timings) so deltas see what training changes; GB/s and "
        f"'vs O_DIRECT'" + (" (against a new file's O_DIRECT write)" if "overwrite_s" in res["disk"] else "")
        + " are of the state's raw size",
        f"{'method':<16}{'save() s':>22}{'blocked s':>22}{'durable s':>22}{'GB/s':>6}{'vs O_DIRECT':>12}"
        f"{'restore s':>22}{'MB written':>12}",
    ]

    def cell(r: Dict[str, Any], key: str) -> str:
        k = key[:-2]
        if f"{k}_min_s" not in r:
            return f"{r[key]:>22.3f}"
        return f"{r[key]:>8.3f} [{r[k + '_min_s']:.3f}-{r[k + '_max_s']:.3f}]".rjust(22)

    for name, r in res["runs"].items():
        lines.append(f"{name:<16}{cell(r, 'stall_s')}{cell(r, 'blocked_s')}{cell(r, 'durable_s')}"
                     f"{gb / r['durable_s']:>6.2f}{r['durable_s'] / res['disk']['write_s']:>11.2f}x{cell(r, 'restore_s')}"
                     + (f"{r['bytes'] / 1e6:>12.1f}" if "bytes" in r else ""))
        if name == "dcp" and "async_durable_s" in r:
            lines.append(f"{'dcp async_save':<16}{cell(r, 'async_stall_s')}{cell(r, 'async_stall_s')}"
                         f"{cell(r, 'async_durable_s')}"
                         f"{gb / r['async_durable_s']:>6.2f}{r['async_durable_s'] / res['disk']['write_s']:>11.2f}x")
    lc = res["runs"].get("layerckpt")
    if lc and lc.get("phases_s"):
        lines.append("layerckpt save by phase (medians): " + ", ".join(
            f"{k} {v:.3f}s" for k, v in lc["phases_s"].items())
            + (" (lazy staging: plan is what save() blocks for; stage runs in the background, and the next "
               "optimizer step waits for what is left of it)"
               if lc.get("lazy_staging") else ""))
    if res.get("compression"):
        c = res["compression"]
        disk = res["state_bytes"] / res["disk"]["write_s"] / 1e9
        verdict = ("encoding keeps up with the disk" if c["gbps"] > disk else
                   "encoded saves are durable later than raw ones here (Config.encoding 'auto' writes raw what "
                   "does not pay)")
        what = c.get("what", "byte-shuffle + zstd (level 1, all cores, no delta)")  # runs before 8f5f6db
        lines += ["", f"{what} on {c['sample_bytes'] / 1e6:.0f} MB of the "
                  f"state: {c['gbps']:.2f} GB/s, {c['ratio']:.2f}x smaller; the disk writes {disk:.2f} GB/s: {verdict}"]
    lc = res["runs"].get("layerckpt")
    if lc:
        lines += ["", f"layerckpt backend {lc['backend']}; first save (allocates the pool) {lc['first_save_durable_s']:.3f}s; "
                  f"restore bit-exact: {lc['restore_bit_exact']}; extra memory during the first save "
                  f"{lc['extra_mem_bytes'] / 1e9:.2f} GB (pool {lc['pool_bytes'] / 1e9:.2f} GB)"]
    if res.get("selective") or res.get("overhead"):
        lines += ["", format_selective(res)]
    if res.get("tiers"):
        from .tiers import format_tiers

        lines += ["", format_tiers(res["tiers"], gb)]
    lines.append("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in res["ratios"].items()))
    return "\n".join(lines)


def format_selective(res: Dict[str, Any]) -> str:
    """The selective saves (k of the model's blocks moved) and the fine-tuning workload's overhead, as
    :func:`format_table` prints them."""
    lines: List[str] = []
    if res.get("selective"):
        lines += [f"selective saves (threshold 0.05) of the same model, k of {res['selective'][-1]['blocks_moved']} "
                  "blocks moved 10%:",
                  f"{'blocks':>8}{'MB written':>12}{'save() s':>10}{'durable s':>11}"]
        for r in res["selective"]:
            lines.append(f"{r['blocks_moved']:>8}{r['bytes'] / 1e6:>12.1f}{r['stall_s']:>10.3f}{r['durable_s']:>11.3f}")
        lines.append(f"drift tracker memory: {res['selective'][0]['tracker_bytes'] / 1e6:.1f} MB")
    if res.get("overhead"):
        o = res["overhead"]
        lines.append(f"fine-tuning workload, default Config, checkpoint every {o['every']} steps: step time "
                     f"{o['overhead'] * 100:+.1f}% against no checkpointing ({o['ckpt_s']:.2f}s vs {o['no_ckpt_s']:.2f}s "
                     f"for {o['steps']} steps), {o['bytes'] / 1e6:.1f} MB written, tracker {o['tracker_bytes'] / 1e3:.0f} kB")
    return "\n".join(lines)


def main(args) -> int:
    cfg = Config.from_yaml(args.config) if args.config else Config()
    if args.chunk_bytes:
        cfg = cfg.replace(chunk_bytes=args.chunk_bytes)
    if args.queue_depth:
        cfg = cfg.replace(queue_depth=args.queue_depth)
    from ..read._fetch import cli_options

    res = run(args.preset, args.dir, args.reps, cfg, args.only, getattr(args, "remote", None),
              cli_options(getattr(args, "remote_options", None)))
    print(json.dumps(res, indent=None if args.json else 2) if args.json else format_table(res))
    return 0
