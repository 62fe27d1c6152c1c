"""Row-block persistence of embedding tables: only the blocks that moved are written; restores assemble them."""
import json
import os

import pytest
import torch

import layerckpt
from layerckpt.select._blocks import split, table_names
from layerckpt.format._manifest import Manifest, load_manifest
from conftest import assert_same_optimizer_state, assert_same_tensors

ROWS, DIM = 4096, 64  # a 1 MiB table: 16 blocks of 256 rows at 64 KiB


class Rec(torch.nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(ROWS, DIM)
        self.mlp = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, ROWS, bias=False) if tied else None
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mlp(self.emb(ids)))
        return self.head(h) if self.head is not None else h.sum()


def cfg(**kw):
    return layerckpt.Config(row_block_bytes="64KiB", keep_last=0, **kw)


def train(model, opt, ids):
    opt.zero_grad()
    out = model(ids)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, ROWS), ids.reshape(-1)) if model.head is not None \
        else out.square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def manifests(d):
    names = sorted(os.listdir(os.path.join(d, "manifests")))
    return [load_manifest(os.path.join(d, "manifests", n)) for n in names]


def test_split_cuts_the_table_and_its_optimizer_state_into_row_views():
    model = Rec()
    tables = table_names(model, 64 * 1024)
    assert tables == {"emb.weight": 256}
    w, m = model.emb.weight.detach(), torch.zeros(ROWS, DIM)
    entries = [("model/emb.weight", w), ("optim/emb.weight/exp_avg", m), ("optim/emb.weight/step", torch.tensor(3.)),
               ("model/mlp.weight", model.mlp.weight.detach())]
    out, blocks = split(entries, tables)
    keys = [k for k, _ in out]
    assert keys[0] == "model/emb.weight#rows=0:256" and keys[15] == "model/emb.weight#rows=3840:4096"
    assert "optim/emb.weight/step" in keys and "model/mlp.weight" in keys and "model/emb.weight" not in keys
    assert blocks["model/emb.weight"].rows[1] == [256, 512] and blocks["model/emb.weight"].dtype == "F32"
    assert set(blocks) == {"model/emb.weight", "optim/emb.weight/exp_avg"}
    piece = dict(out)["model/emb.weight#rows=256:512"]
    assert piece.data_ptr() == w[256].data_ptr() and piece.shape == (256, DIM)  # a view: no copy
    assert table_names(model, 0) == {} and table_names(model, 1 << 20) == {}  # off; smaller than two blocks


def test_only_the_blocks_that_moved_are_written_and_the_restore_is_exact(tmp_path):
    torch.manual_seed(0)
    model = Rec()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    d = str(tmp_path)
    with layerckpt.Checkpointer(d, model, opt, cfg(fidelity=0.0, max_staleness=2)) as ck:
        for step in range(1, 7):  # the batches touch rows 0-99 only: block 0
            loss = train(model, opt, torch.randint(0, 100, (8, 4)))
            ck.save(step, loss=loss).wait()
    ms = manifests(d)
    assert ms[0].layers["emb#rows=0:256"].reason == "first"
    for m in ms[1:]:
        assert m.layers["emb#rows=0:256"].step == m.step and m.layers["mlp"].step == m.step
        for a in range(256, ROWS, 256):  # never rewritten, however far past max_staleness
            e = m.layers[f"emb#rows={a}:{a + 256}"]
            assert (e.step, e.reason) == (1, "unchanged"), (m.step, a)
    data = os.path.join(d, "data")
    size = {f: os.path.getsize(os.path.join(data, f)) for f in os.listdir(data)}
    first = size.pop(next(iter(ms[0].files)))
    assert len(size) == 5 and all(s < first / 8 for s in size.values()), (first, size)  # block 0 + Adam rows + mlp

    # strict: no StalenessError (an unchanged block is current), every tensor assembled bit for bit
    model2 = Rec()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    layerckpt.restore(d, model2, opt2, config=layerckpt.Config(max_staleness=2))
    assert_same_tensors(model2.state_dict(), model.state_dict())
    assert_same_optimizer_state(opt2.state_dict(), opt.state_dict())
    loaded = layerckpt.read_checkpoint(d)
    assert torch.equal(loaded.model["emb.weight"], model.emb.weight)
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])


def test_a_tied_head_is_not_cut_into_row_blocks(tmp_path):
    """A table that is also the output layer's weight is one layer: every row of it is trained at every step (the
    softmax), so its rows are never left stale apart; the tie survives the restore."""
    torch.manual_seed(0)
    model = Rec(tied=True)
    assert table_names(model, 64 * 1024) == {} and table_names(Rec(), 64 * 1024) == {"emb.weight": 256}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    d = str(tmp_path)
    with layerckpt.Checkpointer(d, model, opt, cfg()) as ck:
        for step in range(1, 9):
            loss = train(model, opt, torch.randint(0, 300, (4, 4)))
            ck.save(step, loss=loss).wait()
    m = manifests(d)[-1]
    assert not m.blocks and not any("#rows=" in k for k in m.tensors)
    assert "model/emb.weight" in m.tensors and not any(k.startswith("model/head") for k in m.tensors)
    assert m.aliases == {"head.weight": "emb.weight"}
    assert not any(n.startswith("emb#") for n in m.layers)
    model2 = Rec(tied=True)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    layerckpt.restore(d, model2, opt2, strict=False)
    assert model2.head.weight is model2.emb.weight
    loaded = layerckpt.read_checkpoint(d)
    assert torch.equal(model2.emb.weight, loaded.model["emb.weight"])
    src = layerckpt.read_checkpoint(d, step=m.layers["emb"].step).model["emb.weight"]
    assert torch.equal(loaded.model["emb.weight"], src)  # the table as the save of its layer's step held it


def test_a_table_of_another_size_is_refused_with_its_shapes(tmp_path):
    model = Rec()
    with layerckpt.Checkpointer(str(tmp_path), model, None, cfg(fidelity=0.0)) as ck:
        ck.save(1)
    other = Rec()
    other.emb = torch.nn.Embedding(ROWS // 2, DIM)
    with pytest.raises(layerckpt.CheckpointMismatchError, match=r"emb\.weight: checkpoint \(4096, 64\) F32, model "
                                                                r"\(2048, 64\)"):
        layerckpt.restore(str(tmp_path), other)


def test_malformed_row_blocks_are_named(tmp_path):
    model = Rec()
    with layerckpt.Checkpointer(str(tmp_path), model, None, cfg(fidelity=0.0)) as ck:
        ck.save(1)
    path = os.path.join(str(tmp_path), "manifests", "step-00000001.json")
    raw = json.load(open(path))
    raw["blocks"]["model/emb.weight"]["rows"][3][0] += 1  # a gap between two blocks
    with pytest.raises(layerckpt.CheckpointCorruptError, match="row blocks of tensor 'model/emb.weight'"):
        Manifest.from_dict(raw, path)
    raw = json.load(open(path))
    del raw["tensors"]["model/emb.weight#rows=256:512"]
    with pytest.raises(layerckpt.CheckpointCorruptError, match=r"block 'model/emb.weight#rows=256:512'"):
        Manifest.from_dict(raw, path)
