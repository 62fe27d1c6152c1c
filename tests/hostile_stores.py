"""Genuine stores for the hostile-manifest tests (tests/test_hostile_manifest.py, tests/test_fuzz.py):

- ``delta``: full saves delta-encoded against the versions the store holds (``Config(encoding="delta")``), cut
  in 64 KiB chunks so the bigger tensors are several blocks each;
- ``rows``: selective saves of a model with an embedding table stored in row blocks (``Config.row_block_bytes``),
  raw bytes;
- ``boxes``: the ``rows`` store with its tables recorded as boxes (``Manifest.boxes``, the record a save of a
  DTensor layout writes), each box the same bytes as the row block it replaces, its checksum sealed to the box
  (and to its file's step, as the writers seal every entry).

Each builder returns {step: the state read back right after that step was committed}.
"""
import json
import os
import shutil
from typing import Dict

import torch

import layerckpt
from layerckpt.io._backend import checksum_function
from layerckpt.format._manifest import box_key, split_piece
from layerckpt.format._places import seal

ROWS, DIM = 1024, 64  # a 256 KiB table: four row blocks of 64 KiB


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(ROWS, DIM)
        self.a = torch.nn.Linear(2 * DIM, 2 * DIM)
        self.b = torch.nn.Linear(2 * DIM, 2 * DIM)

    def forward(self, ids):
        h = self.emb(ids).reshape(-1, 2 * DIM)
        return self.b(torch.tanh(self.a(h))).square().mean()


def model_and_optimizer():
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)  # a fine-tune's small steps: deltas pay


def _build(root, config: layerckpt.Config, steps: int = 4) -> Dict[int, Dict[str, torch.Tensor]]:
    model, opt = model_and_optimizer()
    g = torch.Generator().manual_seed(0)
    states = {}
    with layerckpt.Checkpointer(root, model, opt, config=config) as ck:
        for step in range(1, steps + 1):
            ids = torch.randint(0, ROWS, (8, 2), generator=g)
            model(ids).backward()
            opt.step()
            opt.zero_grad()
            ck.save(step).wait()
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return states


def build_delta(root) -> Dict[int, Dict[str, torch.Tensor]]:
    return _build(root, layerckpt.Config(encoding="delta", full=True, keep_last=0, chunk_bytes="64KiB"))


def build_rows(root) -> Dict[int, Dict[str, torch.Tensor]]:
    return _build(root, layerckpt.Config(row_block_bytes="64KiB", encoding="off", keep_last=0))


def manifest_path(root, step: int) -> str:
    return os.path.join(root, "manifests", f"step-{step:08d}.json")


def edit(root, step: int, change) -> None:
    """Change the parsed manifest of ``step`` in place and write it back."""
    path = manifest_path(root, step)
    with open(path) as f:
        d = json.load(f)
    change(d)
    with open(path, "w") as f:
        json.dump(d, f)


def rows_to_boxes(src, dst) -> None:
    """A copy of the row-block store ``src`` whose row blocks are recorded as boxes: block ``[a, b)`` of a table
    of width ``n`` becomes the box at offsets ``[a, 0]`` with sizes ``[b - a, n]``, its entry's checksum sealed
    to its new key and its file's step (computed over its raw bytes in the data file)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".writer.lock"))
    for name in sorted(os.listdir(os.path.join(dst, "manifests"))):
        edit(dst, int(name[5:13]), lambda d: _as_boxes(dst, d))


def _as_boxes(root, d) -> None:
    check = checksum_function(d["checksum"])
    renamed = {}
    d["boxes"] = {}
    for key, rec in d.pop("blocks").items():
        width = rec["shape"][1:]
        d["boxes"][key] = {"dtype": rec["dtype"], "shape": rec["shape"],
                           "boxes": [[[a] + [0] * len(width), [b - a] + width] for a, b in rec["rows"]]}
        for a, b in rec["rows"]:
            old = f"{key}#rows={a}:{b}"
            new = box_key(key, [a] + [0] * len(width), [b - a] + width)
            e = d["tensors"].pop(old)
            with open(os.path.join(root, "data", e["file"]), "rb") as f:
                f.seek(e["offset"])
                raw = f.read(e["nbytes"])
            e["crc"] = seal(check, new, check(raw, 0), d["files"][e["file"]]["step"])
            d["tensors"][new] = e
            renamed[old] = new
    for layer in d["layers"].values():
        layer["tensors"] = [renamed.get(k, k) for k in layer["tensors"]]
    d["version"] = max(d["version"], 3)  # boxes (3), and the writers' seals (5)
    assert not any(split_piece(k)[1] for k in d["tensors"])  # every row block became a box
