"""Issue 66, part 3: ``layerckpt verify`` runs every check a restore runs.

Each hostile variant the suite knows (tests/test_hostile.py, tests/test_hostile_manifest.py, tests/hostile_stores.py,
tests/test_pretrained.py, tests/test_lossy_store.py, tests/test_state_checks.py) is a function ``variant(root)``
that damages a fresh copy of a small genuine store and returns the names (a manifest's, a data file's) the damage is
in.  For every committed step of the damaged copy, ``restore`` (into the model and optimizer that saved the store,
with the Config it needs) and ``read_checkpoint`` are run; ``layerckpt verify`` (in this process, as
tests/test_hostile.py runs it) must exit 1 exactly when one of them refuses a step with the library's own error
(0 when every step restores), fail exactly the manifests of the refused steps, name the damaged manifest or file,
and never print a traceback.

The pretrained store's restores name the pretrained file (``Config(pretrained=...)``); ``verify`` takes no such
path, so of a pretrained reference it checks what needs no file (its manifest entry and its seal): a reference's
dtype or shape, edited, it sees by the seal (``SEALED_SHAPE``).  A composite a strict restore refuses
by its staleness policy alone (``POLICY``: no damage, as a composite written under a laxer policy) verifies."""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import struct
from typing import Callable, Dict, List, Optional

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import hostile_stores as hs
import layerckpt
from layerckpt import cli
from layerckpt.errors import CheckpointError, StalenessError

A, B, EMB = "model/a.weight", "model/b.weight", "model/emb.weight"
ROW0, ROW1 = f"{EMB}#rows=0:256", f"{EMB}#rows=256:512"
BOX0, BOX1 = f"{EMB}#box=0,0:256,64", f"{EMB}#box=256,0:256,64"
QDELTA, QMOM, QSQ = 4, 5, 6  # layerckpt.format._qblock's bounded-loss block modes
HEAD = struct.Struct("<BBBxIf")  # a bounded-loss block's header: width, layout, group, scales, the delta's step


# -- the genuine stores ------------------------------------------------------------------------------------------

def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _tiny_adam():
    model = _tiny()
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _build_state(root: str, _: str) -> None:
    """Two full raw saves of a tiny model with Adam and an extra holding a tensor (test_hostile.py's store, with
    test_state_checks.py's optimizer)."""
    model, opt = _tiny_adam()
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(full=True, keep_last=0,
                                                                         encoding="off")) as ck:
        for step in (1, 2):
            opt.zero_grad()
            model(torch.randn(3, 8)).square().sum().backward()
            opt.step()
            ck.save(step, {"sched": {"lr": 0.5 / step, "hist": torch.arange(4.0) * step}, "n": step}).wait()


class _Net(torch.nn.Module):
    """test_pretrained.py's network: a frozen backbone (held by reference to the pretrained file) under a head."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128))
        self.head = torch.nn.Linear(128, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def _frozen(model: torch.nn.Module):
    for n, p in model.named_parameters():
        p.requires_grad_("head" in n)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _pretrained_file(base: str) -> str:
    return os.path.join(base, "pretrained.safetensors")


def _build_pretrained(root: str, base: str) -> None:
    save_file(_Net(0).state_dict(), _pretrained_file(base))
    model = _Net(0)
    opt = _frozen(model)
    with layerckpt.Checkpointer(root, model, opt,
                                config=layerckpt.Config(pretrained=_pretrained_file(base), keep_last=0)) as ck:
        for step in (1, 2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            ck.save(step).wait()


def _pretrained_restore():
    model = _Net(5)  # not the pretrained weights: the restore takes the frozen tensors from the file, proven
    return model, _frozen(model)


def _lossy_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _build_lossy(root: str, _: str) -> None:
    """test_lossy_store.py's store: three lossy saves (step 1 self-contained, 2 and 3 deltas against it)."""
    model, opt = _lossy_model()
    cfg = layerckpt.Config(encoding="lossy", full=True, keep_last=0, delta_chain=3)
    with layerckpt.Checkpointer(root, model, opt, config=cfg) as ck:
        for step in (1, 2, 3):
            g = torch.Generator().manual_seed(step)
            opt.zero_grad()
            model(torch.randn(16, 128, generator=g)).pow(2).mean().backward()
            opt.step()
            ck.save(step).wait()


# store -> (builder(root, base), the model and optimizer restore is given, the Config restore and read are given)
STORES: Dict[str, tuple] = {
    "state": (_build_state, _tiny_adam, lambda base: None),
    "delta": (lambda root, base: hs.build_delta(root), hs.model_and_optimizer, lambda base: None),
    "rows": (lambda root, base: hs.build_rows(root), hs.model_and_optimizer, lambda base: None),
    "boxes": (None, hs.model_and_optimizer, lambda base: None),  # the rows store recorded as boxes
    "pretrained": (_build_pretrained, _pretrained_restore,
                   lambda base: layerckpt.Config(pretrained=_pretrained_file(base))),
    "lossy": (_build_lossy, _lossy_model, lambda base: None),
}


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """(store name -> its genuine root, each built once on first use; the module's folder, which holds the
    pretrained file)."""
    base = str(tmp_path_factory.mktemp("verify_agrees"))
    built: Dict[str, str] = {}

    def get(store: str) -> str:
        if store not in built:
            root = os.path.join(base, store)
            if store == "boxes":
                hs.rows_to_boxes(get("rows"), root)
            else:
                STORES[store][0](root, base)
            built[store] = root
        return built[store]

    return get, base


# -- helpers the variants share -----------------------------------------------------------------------------------

def _mname(step: int) -> str:
    return f"step-{step:08d}.json"


def _mpath(root: str, step: int) -> str:
    return os.path.join(root, "manifests", _mname(step))


def _load(root: str, step: int) -> dict:
    with open(_mpath(root, step)) as f:
        return json.load(f)


def _edit(root: str, step: int, change: Callable[[dict], None]) -> List[str]:
    """Change the parsed manifest of ``step`` in place; the manifest's name."""
    d = _load(root, step)
    change(d)
    with open(_mpath(root, step), "w") as f:
        f.write(json.dumps(d).replace("NaN", "1e999"))
    return [_mname(step)]


def _data(root: str, fname: str) -> str:
    return os.path.join(root, "data", fname)


def _poke(path: str, offset: int, fn: Callable[[bytes], bytes], n: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(n)
        f.seek(offset)
        f.write(fn(old))


def _xor(b: bytes) -> bytes:
    return bytes(x ^ 0x5A for x in b)


def _stored_byte(e: dict) -> int:
    if e.get("enc"):
        off, n = next(b[:2] for b in e["enc"]["blocks"] if b[1] > 0)
        return off + n // 2
    return e["offset"] + e["nbytes"] // 2


def _flip_tensor(step: int, key: str):
    """A byte in the middle of ``key``'s stored bytes (as step ``step`` records them) flipped in its file."""
    def variant(root):
        e = _load(root, step)["tensors"][key]
        _poke(_data(root, e["file"]), _stored_byte(e), _xor)
        return [e["file"]]
    return variant


def _manifest_edit(step: int, change: Callable[[dict], None]):
    return lambda root: _edit(root, step, change)


def _text_edit(step: int, change: Callable[[bytes], bytes]):
    def variant(root):
        with open(_mpath(root, step), "rb") as f:
            raw = f.read()
        with open(_mpath(root, step), "wb") as f:
            f.write(change(raw))
        return [_mname(step)]
    return variant


def _set(step: int, path: list, value):
    def change(d):
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return _manifest_edit(step, change)


def _file_of(root: str, step: int, own: bool = True) -> str:
    """The data file step ``step`` wrote (``own``), else the first other file its manifest lists."""
    files = _load(root, step)["files"]
    return sorted(f for f, e in files.items() if (e["step"] == step) == own)[0]


# -- the variants --------------------------------------------------------------------------------------------------

def _truncated(step: int, own: bool = True):
    def variant(root):
        f = _file_of(root, step, own)
        with open(_data(root, f), "r+b") as fh:
            fh.truncate(os.path.getsize(_data(root, f)) // 2)
        return [f]
    return variant


def _missing(step: int, own: bool = True):
    def variant(root):
        f = _file_of(root, step, own)
        os.unlink(_data(root, f))
        return [f]
    return variant


def _linked(step: int):
    """The data file replaced by a symbolic link to a copy of itself: the reads refuse a link."""
    def variant(root):
        f = _file_of(root, step)
        os.rename(_data(root, f), os.path.join(root, "elsewhere"))
        os.symlink(os.path.join(root, "elsewhere"), _data(root, f))
        return [f]
    return variant


def _duplicate_key(root):
    """A second "model/0.weight" entry pointing at model/0.bias's bytes (test_hostile.py)."""
    def change(raw: bytes) -> bytes:
        text = raw.decode()
        entry = json.dumps(json.loads(text)["tensors"]["model/0.bias"])
        return text.replace('"model/0.weight": {', '"model/0.weight": ' + entry + ', "model/0.weight": {', 1).encode()
    _edit(root, 2, lambda d: None)  # written back with json.dumps' separators
    return _text_edit(2, change)(root)


def _copy_fields(step: int, src: str, dst: str, fields=("file", "offset", "crc", "enc")):
    def change(d):
        for f in fields:
            d["tensors"][dst][f] = d["tensors"][src][f]
    return _manifest_edit(step, change)


def _swap(step: int, x: str, y: str, fields=("file", "offset", "crc", "enc")):
    def change(d):
        t = d["tensors"]
        for f in fields:
            t[x][f], t[y][f] = t[y][f], t[x][f]
    return _manifest_edit(step, change)


def _rolled_back(*keys, file_step: Optional[int] = None):
    """``keys`` given their own entries of step 3 (with step 3's files listed) in the manifest of step 4
    (test_hostile_manifest.py)."""
    def variant(root):
        old = _load(root, 3)

        def change(d):
            for k in keys:
                d["tensors"][k] = old["tensors"][k]
            d["files"].update(old["files"])
            if file_step is not None:
                d["files"][old["tensors"][keys[0]]["file"]]["step"] = file_step
        return _edit(root, 4, change)
    return variant


def _whole_step_rolled_back(root):
    """The manifest of step 4 replaced by step 3's, renamed: its name says 4, its step 3."""
    shutil.copyfile(_mpath(root, 3), _mpath(root, 4))
    return [_mname(4)]


def _crc(step: int, key: str):
    def change(d):
        d["tensors"][key]["crc"] ^= 1
    return _manifest_edit(step, change)


def _lossy_block(root: str, step: int, key: str, mode: int):
    e = _load(root, step)["tensors"][key]
    off, n, _, _ = next(b for b in e["enc"]["blocks"] if b[3] == mode)
    return e["file"], off, n


def _lossy_scale(step: int, key: str, value: Optional[float]):
    """The first scale of ``key``'s moment block forged: ``value``, or None: doubled."""
    def variant(root):
        fname, off, _ = _lossy_block(root, step, key, QMOM)
        at = off + HEAD.size

        def forged(old: bytes) -> bytes:
            v = struct.unpack("<f", old)[0]
            return struct.pack("<f", v * 2 if value is None else value)
        _poke(_data(root, fname), at, forged, 4)
        return [fname]
    return variant


def _lossy_step(step: int, key: str, factor: float):
    """The quantum (the delta's step) in the header of ``key``'s bounded-loss delta block, times ``factor``."""
    def variant(root):
        fname, off, _ = _lossy_block(root, step, key, QDELTA)

        def forged(old: bytes) -> bytes:
            fields = list(HEAD.unpack(old))
            fields[4] *= factor
            return HEAD.pack(*fields)
        _poke(_data(root, fname), off, forged, HEAD.size)
        return [fname]
    return variant


def _lossy_ranges(step: int, key: str):
    """A second-moment block's first value range reversed (its low end above its high end)."""
    def variant(root):
        fname, off, _ = _lossy_block(root, step, key, QSQ)
        at = off + HEAD.size

        def forged(old: bytes) -> bytes:
            lo, hi = struct.unpack("<ii", old)
            return struct.pack("<ii", hi + 1, lo)
        _poke(_data(root, fname), at, forged, 8)
        return [fname]
    return variant


def _lossy_header(step: int, key: str):
    """The code width in the header of ``key``'s bounded-loss delta block made 3 (no width a code has)."""
    def variant(root):
        fname, off, _ = _lossy_block(root, step, key, QDELTA)
        _poke(_data(root, fname), off, lambda b: b"\x03")
        return [fname]
    return variant


PRE_A, PRE_B = "model/backbone.0.bias", "model/backbone.2.bias"  # the same dtype and shape
PRE_W = "model/backbone.0.weight"


def _pre(change: Callable[[dict], None], step: int = 2):
    return _manifest_edit(step, lambda d: change(d["pretrained"]))


def _pre_swapped(p):
    p[PRE_A], p[PRE_B] = p[PRE_B], p[PRE_A]


def _pre_copied(p):
    p[PRE_B] = dict(p[PRE_A])


def _pre_seal(p):
    p[PRE_W]["seal"] ^= 1


def _pre_fp(p):
    p[PRE_W]["fp"] = [p[PRE_W]["fp"][0] ^ 1]


def _pre_dtype(p):
    p[PRE_W]["dtype"] = "I32"  # as many bytes; not sealed


def _pre_shape(p):
    p[PRE_W]["shape"] = list(reversed(p[PRE_W]["shape"]))  # [32, 128]: as many bytes; not sealed


def _pre_step(p):
    p[PRE_W]["step"] = 2


def _pre_gone(p):
    del p[PRE_W]


def _opt_entry(key: str, **fields):
    """A tensor entry's dtype or shape changed to others of as many bytes: its checksum still matches."""
    def change(d):
        d["tensors"][key].update(fields)
    return _manifest_edit(2, change)


def _param_group_without(name: str):
    def change(d):
        for g in d["optimizer"]["param_groups"]:
            g["params"] = [p for p in g["params"] if p != name]
    return _manifest_edit(2, change)


def _opt_state_renamed(d):
    st = d["optimizer"]["state"]
    st["nowhere.weight"] = st.pop("0.weight")


def _rng_python(d):
    d["rng"]["python"] = {"__tuple__": [3, {"__tuple__": [1, 2, 3]}, None]}


def _rng_numpy_name(d):
    d["rng"]["numpy"]["__tuple__"][0] = "MT19938"


def _rng_torch_other(d):
    d["rng"]["torch"] = {"__tensor__": "rng/numpy/1"}


def _rng_torch_reshaped(d):
    d["tensors"]["rng/torch"].update(dtype="I32", shape=[d["tensors"]["rng/torch"]["nbytes"] // 4])


def _rng_gone(d):
    d["rng"] = ["not", "an", "object"]


def _extra_malformed(d):
    d["extra"]["sched"] = {"__tuple__": 5}


def _extra_unknown_tensor(d):
    d["extra"]["sched"]["hist"] = {"__tensor__": "extra/nowhere"}


def _extra_other_tensor(d):
    d["extra"]["sched"]["hist"] = {"__tensor__": "model/0.bias"}


def _model_other_malformed(d):
    d["model"]["other"] = {"0._extra_state": {"__ndarray__": 7}}


def _layer_age(d):
    for e in d["layers"].values():
        e["age"] = 100


def _loss_increase(d):
    d["cost"], d["loss"] = 0.5, 1.0  # an estimated loss increase of 50%


# name -> (store, variant or None for the genuine store); the variants of each kind the brief lists:
VARIANTS: Dict[str, tuple] = {
    # controls: the genuine stores verify and restore
    "state untouched": ("state", None),
    "delta untouched": ("delta", None),
    "rows untouched": ("rows", None),
    "boxes untouched": ("boxes", None),
    "pretrained untouched": ("pretrained", None),
    "lossy untouched": ("lossy", None),
    # manifest field damage (test_hostile.py FIELDS / CONTENT, test_hostile_manifest.py raw exceptions)
    "step differs from the name": ("state", _set(2, ["step"], 7)),
    "tensor shape of strings": ("state", _manifest_edit(2, lambda d: d["tensors"]["model/0.bias"].update(
        shape=["8"]))),
    "version 0": ("state", _set(2, ["version"], 0)),
    "seq a string": ("state", _set(2, ["seq"], "1")),
    "layer reason an int": ("state", _manifest_edit(2, lambda d: [e.update(reason=3) for e in d["layers"].values()])),
    "truncated JSON": ("state", _text_edit(2, lambda t: t[: len(t) // 2])),
    "a duplicate tensor key": ("state", _duplicate_key),
    "tensor past its file": ("state", _manifest_edit(2, lambda d: d["files"].update(
        {k: dict(v, size=8) for k, v in d["files"].items()}))),
    "a dtype list in an entry": ("delta", _set(4, ["tensors", A, "dtype"], ["F32"])),
    "an alias to a missing tensor": ("delta", _set(4, ["model", "aliases"], {"head.weight": "gone.weight"})),
    "a NaN cost": ("delta", _set(4, ["cost"], float("nan"))),
    "a model tensor reshaped (as many bytes)": ("state", _opt_entry("model/0.weight", shape=[4, 16])),
    # CRC flipped
    "crc flipped (raw)": ("state", _crc(2, "model/0.weight")),
    "crc flipped (encoded)": ("delta", _crc(4, "model/a.bias")),
    "a seal cleared": ("delta", _manifest_edit(4, lambda d: d["tensors"][A].update(crc=d["tensors"][A]["crc"]
                                                                                   & 0xFFFFFFFF))),
    # data byte flipped
    "data byte flipped (raw weight)": ("state", _flip_tensor(2, "model/0.weight")),
    "data byte flipped (encoded weight)": ("delta", _flip_tensor(4, "model/a.bias")),
    "data byte flipped (delta reference)": ("delta", _flip_tensor(1, A)),
    "data byte flipped (row block)": ("rows", _flip_tensor(4, ROW1)),
    "data byte flipped (box)": ("boxes", _flip_tensor(4, BOX0)),
    # missing, truncated, not a file
    "data file missing": ("state", _missing(2)),
    "delta reference file missing": ("delta", _missing(4, own=False)),
    "data file truncated": ("state", _truncated(1)),
    "delta reference file truncated": ("delta", _truncated(4, own=False)),
    "data file a symbolic link": ("rows", _linked(4)),
    # rolled back to an older step
    "an entry of an older step (encoded)": ("delta", _rolled_back(B)),
    "an entry of an older step (raw)": ("rows", _rolled_back(A)),
    "a layer's entries of an older step": ("delta", _rolled_back(B, "model/b.bias", "optim/b.weight/exp_avg")),
    "an RNG state of an older step": ("delta", _rolled_back("rng/torch")),
    "an older file's entry claiming this step": ("delta", _rolled_back(B, file_step=4)),
    "a layer claiming a newer step": ("boxes", _manifest_edit(4, lambda d: d["layers"]["emb#rows=0:256"].update(
        step=4, age=0))),
    "the whole manifest of the step before": ("delta", _whole_step_rolled_back),
    # one tensor's entry swapped with (or copied onto) another's
    "blocks and checksums swapped": ("delta", _swap(4, A, B)),
    "raw entries swapped": ("state", _swap(2, "optim/0.weight/exp_avg", "optim/0.weight/exp_avg_sq",
                                           ("file", "offset", "crc"))),
    "references swapped": ("delta", _manifest_edit(4, lambda d: d["tensors"][A]["enc"].update(
        ref=d["tensors"][B]["enc"]["ref"]))),
    "blocks and checksum copied": ("delta", _copy_fields(4, A, B)),
    # bounded-loss blocks (test_lossy_store.py)
    "lossy scale forged NaN": ("lossy", _lossy_scale(3, "optim/0.weight/exp_avg", float("nan"))),
    "lossy scale forged doubled": ("lossy", _lossy_scale(3, "optim/2.weight/exp_avg", None)),
    "lossy delta step forged doubled": ("lossy", _lossy_step(3, "model/0.weight", 2.0)),
    "lossy delta step forged zero": ("lossy", _lossy_step(2, "model/2.bias", 0.0)),
    "lossy value ranges forged": ("lossy", _lossy_ranges(3, "optim/0.weight/exp_avg_sq")),
    "lossy header byte flipped": ("lossy", _lossy_header(3, "model/0.weight")),
    "lossy record malformed": ("lossy", _manifest_edit(3, lambda d: d["tensors"]["model/0.weight"]["enc"]["lossy"]
                                                       .update(code="bogus"))),
    "lossy record's scale forged negative": ("lossy", _manifest_edit(
        3, lambda d: d["tensors"]["model/0.weight"]["enc"]["lossy"].update(move=-1.0))),
    "lossy blocks in an integer tensor": ("lossy", _manifest_edit(
        3, lambda d: d["tensors"]["rng/torch"]["enc"]["blocks"][0].__setitem__(3, QMOM))),
    # pretrained references (test_pretrained.py)
    "pretrained seal broken": ("pretrained", _pre(_pre_seal)),
    "pretrained entries swapped": ("pretrained", _pre(_pre_swapped)),
    "pretrained entry copied from another key": ("pretrained", _pre(_pre_copied)),
    "pretrained fingerprint forged": ("pretrained", _pre(_pre_fp)),
    "pretrained fingerprint of 2 parts": ("pretrained", _pre(lambda p: p[PRE_W].update(fp=p[PRE_W]["fp"] + [1]))),
    "pretrained name empty": ("pretrained", _pre(lambda p: p[PRE_W].update(name=""))),
    "pretrained nbytes off": ("pretrained", _pre(lambda p: p[PRE_W].update(nbytes=p[PRE_W]["nbytes"] + 4))),
    "pretrained entry of another step": ("pretrained", _pre(_pre_step)),
    "pretrained entry deleted": ("pretrained", _pre(_pre_gone)),
    "pretrained dtype changed (as many bytes)": ("pretrained", _pre(_pre_dtype)),
    "pretrained shape changed (as many bytes)": ("pretrained", _pre(_pre_shape)),
    # row blocks and boxes (test_hostile_manifest.py)
    "row block copied": ("rows", _copy_fields(4, ROW0, ROW1, ("file", "offset", "crc"))),
    "row blocks swapped": ("rows", _swap(4, ROW0, ROW1, ("file", "offset", "crc"))),
    "an empty row block list": ("rows", _set(4, ["blocks", EMB, "rows"], [])),
    "a dtype list in row blocks": ("rows", _set(4, ["blocks", EMB, "dtype"], ["F32"])),
    "boxes swapped": ("boxes", _swap(4, BOX0, BOX1, ("file", "offset", "crc"))),
    "boxes of 2**80 empty elements": ("boxes", _set(4, ["boxes", EMB, "shape"], [1 << 40, 1 << 40, 0])),
    "a box's table reshaped": ("boxes", _set(4, ["boxes", EMB, "shape"], [2048, 32])),
    # RNG and extra
    "RNG python state malformed": ("state", _manifest_edit(2, _rng_python)),
    "RNG numpy kind unknown": ("state", _manifest_edit(2, _rng_numpy_name)),
    "RNG torch state another tensor": ("state", _manifest_edit(2, _rng_torch_other)),
    "RNG torch state reinterpreted": ("state", _manifest_edit(2, _rng_torch_reshaped)),
    "RNG record not an object": ("state", _manifest_edit(2, _rng_gone)),
    "RNG data byte flipped": ("state", _flip_tensor(2, "rng/torch")),
    "extra malformed": ("state", _manifest_edit(2, _extra_malformed)),
    "extra refers to no tensor": ("state", _manifest_edit(2, _extra_unknown_tensor)),
    "extra refers to a model tensor": ("state", _manifest_edit(2, _extra_other_tensor)),
    "extra data byte flipped": ("state", _flip_tensor(2, "extra/sched/hist")),
    "non-tensor model state malformed": ("state", _manifest_edit(2, _model_other_malformed)),
    # optimizer state (test_state_checks.py, test_hostile_manifest.py)
    "optimizer state of another dtype": ("state", _opt_entry("optim/0.weight/exp_avg", dtype="I32")),
    "optimizer state of another shape": ("state", _opt_entry("optim/0.weight/exp_avg", shape=[4, 16])),
    "optimizer state flattened": ("state", _opt_entry("optim/1.weight/exp_avg_sq", shape=[32])),
    "optimizer step not a scalar": ("state", _set(2, ["optimizer", "state", "1.bias", "step"], [1, 2])),
    "optimizer step a string": ("state", _set(2, ["optimizer", "state", "1.bias", "step"], "one")),
    "another parameter's moments": ("delta", _set(4, ["optimizer", "state", "a.weight", "exp_avg"],
                                                  {"__tensor__": "optim/b.weight/exp_avg"})),
    "optimizer state of no parameter": ("state", _manifest_edit(2, _opt_state_renamed)),
    "a parameter left out of its group": ("state", _param_group_without("1.bias")),
    "param_groups not a list": ("state", _set(2, ["optimizer", "param_groups"], {"params": []})),
    "optimizer data byte flipped": ("state", _flip_tensor(2, "optim/0.weight/exp_avg_sq")),
    "optimizer state data byte flipped (delta)": ("delta", _flip_tensor(4, "optim/b.weight/exp_avg")),
    # the restore's staleness policy (not damage: see POLICY)
    "layers' age forged past max_staleness": ("state", _manifest_edit(2, _layer_age)),
    "a loss increase forged past the allowance": ("state", _manifest_edit(2, _loss_increase)),
}

#: a reference's dtype or shape edited to as many bytes keeps its nbytes and fingerprint sound: verify, without the
#: pretrained file, sees it by the seal alone (``format._places.pretrained_seal`` covers them since format version 8)
SEALED_SHAPE = {"pretrained dtype changed (as many bytes)", "pretrained shape changed (as many bytes)"}
assert SEALED_SHAPE <= set(VARIANTS)  # they are among the variants run

#: variants a strict restore refuses by its staleness policy (StalenessError: layers older than the caller's
#: max_staleness, or an estimated loss increase past the allowance), which a composite genuinely written under a
#: laxer policy meets too: nothing is damaged, and verify (which takes no Config) passes them, while restore and
#: read_checkpoint with strict=False read them
POLICY = {"layers' age forged past max_staleness", "a loss increase forged past the allowance"}


# -- the harness ----------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _rng_kept():
    """A restore sets the process's RNG: put it back for the tests after this one."""
    py, npy, tt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(tt)


def _verify(root: str) -> tuple:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(["verify", "-q", root])
    return rc, out.getvalue()


def _refusals(store: str, root: str, base: str) -> Dict[str, List[CheckpointError]]:
    """Each committed manifest -> the errors restore and read_checkpoint of its step refuse it with (none: both
    succeed).  Any other exception fails the test."""
    _, make, config = STORES[store]
    out: Dict[str, List[CheckpointError]] = {}
    for name in sorted(os.listdir(os.path.join(root, "manifests"))):
        step = int(name[5:13])
        out[name] = []
        for call in (lambda: layerckpt.restore(root, *make(), step=step, config=config(base)),
                     lambda: layerckpt.read_checkpoint(root, step, config=config(base))):
            try:
                with _rng_kept():
                    call()
            except CheckpointError as e:
                out[name].append(e)
    return out


def _failed(text: str) -> set:
    """The manifests verify reports failed."""
    return {m.group(1) for m in re.finditer(r"^FAIL (step-\d+\.json)", text, re.M)}


@pytest.mark.parametrize("name", [n for n in VARIANTS if n not in POLICY])
def test_verify_fails_exactly_what_restore_refuses(genuine, tmp_path, name):
    get, base = genuine
    store, variant = VARIANTS[name]
    root = str(tmp_path / store)
    shutil.copytree(get(store), root, ignore=shutil.ignore_patterns(".writer.lock"), symlinks=True)
    named = variant(root) if variant is not None else []
    rc, text = _verify(root)
    assert "Traceback" not in text, text
    refused = _refusals(store, root, base)
    assert rc == (1 if any(refused.values()) else 0), (rc, refused, text)
    want = {n for n, why in refused.items() if why}
    assert _failed(text) == want, (refused, text)
    for n in named if want else ():  # the damaged manifest or data file, by name
        assert n in text, (n, text)
    assert (variant is None) == (not want), (name, refused)  # every variant is damage a restore meets


@pytest.mark.parametrize("name", sorted(POLICY))
def test_a_composite_restore_refuses_by_its_staleness_policy_alone_verifies(genuine, tmp_path, name):
    get, base = genuine
    store, variant = VARIANTS[name]
    root = str(tmp_path / store)
    shutil.copytree(get(store), root, ignore=shutil.ignore_patterns(".writer.lock"))
    named = variant(root)
    rc, text = _verify(root)
    assert rc == 0 and "Traceback" not in text, text
    refused = _refusals(store, root, base)
    assert not refused[_mname(1)] and [type(e) for e in refused[named[0]]] == [StalenessError] * 2, refused
    _, make, config = STORES[store]
    with _rng_kept():
        layerckpt.restore(root, *make(), step=2, strict=False)
        layerckpt.read_checkpoint(root, 2, strict=False)
