"""`layerckpt bench --lightning`: Lightning's checkpoint dict saved by LayerCheckpointIO against Lightning's
own ``TorchCheckpointIO`` and ``AsyncCheckpointIO(TorchCheckpointIO())``.

A GPT-2-shaped LightningModule (``--size``, as ``--sharded``) trains one step in a real Trainer so that
AdamW has its moments; ``trainer._checkpoint_connector.dump_checkpoint()`` gives the dict that
``trainer.save_checkpoint`` and ModelCheckpoint hand to the CheckpointIO.  Each contender then saves
that dict to a new file, the same number of timed repeats each (after one untimed warm-up each, the
save that allocates LayerCheckpointIO's staging pool among them), in turns:

- "blocked": the ``save_checkpoint`` call, which is what training waits for;
- "durable": from the call until the file is on disk: ``LayerCheckpointIO.wait()`` (it fsyncs and
  renames); ``TorchCheckpointIO`` returns with the file in the page cache, so an fsync of the file
  and its directory follows; ``AsyncCheckpointIO`` has no wait, so its ``teardown()`` (which joins its
  thread) and the same fsync follow.

Beside them, the machine's own limits for the same bytes: a memcpy (one thread) and an O_DIRECT write.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from .cases import summary
from .sharded import SIZES, _fmt, disk_reference, fsync_files, machine, timed

CONTENDERS = ("LayerCheckpointIO", "TorchCheckpointIO", "AsyncCheckpointIO")


def checkpoint_dict(size: str, root: str) -> Dict[str, Any]:
    """What a Trainer hands its CheckpointIO after one training step of a GPT of ``size``."""
    import lightning.pytorch as L

    from .models import GPT

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = GPT(SIZES[size])

        def training_step(self, batch, i):
            c = self.net.config
            x = torch.randint(0, c.vocab_size, (2, min(64, c.n_positions) + 1))
            return torch.nn.functional.cross_entropy(self.net(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.arange(8), batch_size=1)

    t = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    t.fit(LitGPT())
    return t._checkpoint_connector.dump_checkpoint(weights_only=False)


def tensors_of(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors_of(x)]
    return []


def memcpy_s(ts: List[torch.Tensor], reps: int = 3) -> float:
    """The best time to copy these tensors' bytes into one prefaulted buffer (numpy: one thread)."""
    dst = np.ones(sum(t.numel() * t.element_size() for t in ts), dtype=np.uint8)
    best = float("inf")
    for _ in range(reps):
        t0, o = time.perf_counter(), 0
        for t in ts:
            src = t.detach().reshape(-1).view(torch.uint8).numpy()
            dst[o:o + len(src)] = src
            o += len(src)
        best = min(best, time.perf_counter() - t0)
    return best


def savers(ckpt: Dict[str, Any], root: str) -> Dict[str, Callable[[str], Callable[[], Any]]]:
    """Per contender: save to a path, return the wait until it is durable."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_layerckpt import LayerCheckpointIO

    ours, plain, later = LayerCheckpointIO(), TorchCheckpointIO(), AsyncCheckpointIO(TorchCheckpointIO())

    def layer(path):
        ours.save_checkpoint(ckpt, path)
        return ours.wait

    def torch_io(path):
        plain.save_checkpoint(ckpt, path)
        return lambda: fsync_files([path], root)

    def async_io(path):
        later.save_checkpoint(ckpt, path)
        return lambda: (later.teardown(), fsync_files([path], root))

    return {"LayerCheckpointIO": layer, "TorchCheckpointIO": torch_io, "AsyncCheckpointIO": async_io,
            "_close": lambda: (ours.teardown(), later.teardown())}


def bench(size: str = "gpt2-small", reps: int = 5, dirpath: Optional[str] = None) -> Dict[str, Any]:
    if dirpath:
        os.makedirs(dirpath, exist_ok=True)
    root = tempfile.mkdtemp(prefix="layerckpt-bench-lightning-", dir=dirpath)
    try:
        ckpt = checkpoint_dict(size, os.path.join(root, "trainer"))
        ts = tensors_of(ckpt)
        nbytes = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in ts}.values())
        fns = savers(ckpt, root)
        res: Dict[str, Any] = {"size": size, "reps": reps, "state_bytes": nbytes, "machine": machine(),
                               "tensors": len(ts), "runs": {n: {"blocked": [], "durable": [], "bytes": 0}
                                                            for n in CONTENDERS}}
        for name in CONTENDERS:  # warm-up: LayerCheckpointIO allocates its staging pool here
            path = os.path.join(root, "warm.ckpt")
            blocked, durable = timed(lambda: fns[name](path))
            res["runs"][name].update(first_blocked_s=blocked, first_durable_s=durable, bytes=os.path.getsize(path))
            os.unlink(path)
        for rep in range(reps):
            for i in range(len(CONTENDERS)):  # a different one goes first each repeat
                name = CONTENDERS[(rep + i) % len(CONTENDERS)]
                path = os.path.join(root, f"{rep}.ckpt")
                blocked, durable = timed(lambda: fns[name](path))
                res["runs"][name]["blocked"].append(blocked)
                res["runs"][name]["durable"].append(durable)
                if name == "LayerCheckpointIO" and rep == reps - 1:
                    res["bit_exact"] = same_tensors(ckpt, torch.load(path, weights_only=True, mmap=True))
                os.unlink(path)
        fns["_close"]()
        res["reference"] = dict(disk_reference(root, nbytes), memcpy_s=memcpy_s(ts))
        for r in res["runs"].values():
            r.update(blocked_stats=summary(r["blocked"]), durable_stats=summary(r["durable"]))
        med = {n: (r["blocked_stats"]["median"], r["durable_stats"]["median"]) for n, r in res["runs"].items()}
        ours = med["LayerCheckpointIO"]
        res["ratios"] = {
            "TorchCheckpointIO blocked / ours": med["TorchCheckpointIO"][0] / ours[0],
            "TorchCheckpointIO durable / ours": med["TorchCheckpointIO"][1] / ours[1],
            "AsyncCheckpointIO blocked / ours": med["AsyncCheckpointIO"][0] / ours[0],
            "AsyncCheckpointIO durable / ours": med["AsyncCheckpointIO"][1] / ours[1],
            "ours durable / O_DIRECT write": ours[1] / res["reference"]["write_s"],
            "ours blocked / memcpy": ours[0] / res["reference"]["memcpy_s"],
        }
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def same_tensors(a: Any, b: Any) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                      for x, y in zip(ta, tb))


def format_table(res: Dict[str, Any]) -> str:
    m, ref = res["machine"], res["reference"]
    gb = res["state_bytes"] / 1e9
    lines = [
        f"layerckpt bench --lightning: {res['size']}, {gb:.2f} GB in {res['tensors']} tensors (model + AdamW, "
        f"Lightning's checkpoint dict after one step); {res['reps']} timed repeats each after one warm-up: "
        f"median [min-max]",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.1f} GiB RAM, kernel {m['kernel']}, "
        f"torch {m['torch']}",
        f"reference (the same bytes): memcpy {ref['memcpy_s']:.3f}s ({gb / ref['memcpy_s']:.1f} GB/s), "
        f"O_DIRECT write {ref['write_s']:.3f}s ({gb / ref['write_s']:.2f} GB/s)",
        "",
        f"{'CheckpointIO':<20}{'blocked s':>24}{'durable s':>24}{'file MB':>10}",
    ]
    for name, r in res["runs"].items():
        lines.append(f"{name:<20}{_fmt(r['blocked']):>24}{_fmt(r['durable']):>24}{r['bytes'] / 1e6:>10.1f}")
    ours = res["runs"]["LayerCheckpointIO"]
    lines += ["", f"LayerCheckpointIO first save (allocates the staging pool, the untimed warm-up): blocked "
              f"{ours['first_blocked_s']:.3f}s, durable {ours['first_durable_s']:.3f}s; its file loads bit-exact "
              f"with torch.load(weights_only=True, mmap=True): {res.get('bit_exact')}",
              "ratios (medians, same run): " + ", ".join(f"{k} = {v:.2f}x" for k, v in res["ratios"].items())]
    return "\n".join(lines)


def main(args) -> int:
    """``layerckpt bench --lightning`` (args: size, reps, dir, json)."""
    if args.size not in SIZES:
        raise SystemExit(f"--size must be one of {', '.join(SIZES)}")
    res = bench(args.size, max(1, args.reps), args.dir)
    print(json.dumps(res) if args.json else format_table(res), flush=True)
    return 0
