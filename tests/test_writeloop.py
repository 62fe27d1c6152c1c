"""The stager -> writer hand-off (_stage, _writeloop) and the ranks' results (_commit)."""
import json

import pytest
import torch

import layerckpt
from layerckpt.write import _commit
from layerckpt import _faults
from layerckpt.format._layout import DTYPES
from layerckpt.format._manifest import TensorEntry
from conftest import assert_same_tensors


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    return model, opt


def test_a_staging_failure_with_writes_in_flight_gives_every_buffer_back(tmp_path, backend):
    """Staging fails once many chunks went to the writer: the writes in flight are waited out and every
    buffer goes back, so the next saves neither run short of buffers nor see the old writes complete."""
    model, opt = _model()
    cfg = layerckpt.Config(threshold=0.0, chunk_bytes=64 * 1024, staging_bytes=1 << 20, lazy_staging=True)
    ck = layerckpt.Checkpointer(str(tmp_path), model, opt, cfg)

    def boom():
        raise RuntimeError("staging refused")

    _faults.install("stage.copied", boom)
    try:
        p = ck.save(1)
        with pytest.raises(RuntimeError, match="staging refused"):
            p.wait(60)
    finally:
        _faults.remove("stage.copied")
    assert len(ck.pool._free) == len(ck.pool.chunks) > 1  # every buffer is back
    for step in (2, 3):
        ck.save(step).wait(60)
    ck.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for v in model.parameters():
        v.data.zero_()
    assert layerckpt.restore(str(tmp_path), model, opt).step == 3
    assert_same_tensors(model.state_dict(), want)


def test_a_rank_result_crosses_as_json_and_back():
    entry = TensorEntry(file="f", dtype=DTYPES[torch.float32], shape=[2, 3], offset=4096, nbytes=24, crc=7)
    ok = _commit.RankResult(1, "f", 8192, {"torch": [1, 2]}, tensors={"model/w": entry})
    failed = _commit.RankResult(2, "g", 4096, None, _commit.RankFailure(28, "/x/g", "No space left"))
    for r in (ok, failed):
        assert _commit.RankResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r
