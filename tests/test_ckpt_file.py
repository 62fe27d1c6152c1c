"""Standard torch.save files written through layerckpt's writer (layerckpt.write._torchfile) and LayerCheckpointIO."""
import errno
import fcntl
import io
import os
import threading

import pytest
import torch
from torch.utils.serialization import config as torch_config

import layerckpt
from layerckpt.write import _torchfile
from layerckpt.write._torchfile import TorchFileWriter
from conftest import assert_same_optimizer_state

SMALL = layerckpt.Config(chunk_bytes="8KiB", staging_bytes="64KiB")  # images span many chunks; back-pressure
REAL_BACKEND = _torchfile.make_backend


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a, b) -> None:
    """Nested dicts/lists/tuples of tensors and plain values, tensors equal bit for bit (views and strides too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset() and torch.equal(bits(a), bits(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_bit_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_bit_equal(x, y)
    else:
        assert a == b


def sample() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 70, generator=g)
    same = [torch.randn(64, 32, generator=g) for _ in range(4)]  # equal sizes: the storage order must be right
    return {
        "base": base, "rows": base[10:20], "cols": base[:, 5:9], "t": base.t(),  # views of one storage
        "bf16": torch.randn(1001, generator=g).to(torch.bfloat16), "i64": torch.arange(-5000, 5000),
        "empty": torch.empty(0), "empty2d": torch.zeros(0, 7, dtype=torch.int64), "scalar": torch.tensor(3.5),
        "same": same, "nested": {"a": [same[2], {"b": (torch.ones(3, dtype=torch.bool), 7)}], "none": None},
        "plain": {"epoch": 3, "lr": 1e-3, "name": "run", "betas": (0.9, 0.999), "flags": [True, False]},
    }


@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_is_torch_save_bit_for_bit(tmp_path, backend, mmap):
    obj = sample()
    w = TorchFileWriter(SMALL)
    path = str(tmp_path / "a.ckpt")
    p = w.save(obj, path)
    p.wait()
    w.close()
    assert torch_config.save.storage_alignment == 64 and torch_config.save.compute_crc32  # torch's config restored
    ref = io.BytesIO()
    with torch_config.patch(_torchfile._LAYOUT):
        torch.save(obj, ref)
    data = open(path, "rb").read()
    assert data == ref.getvalue() and p.nbytes == len(data) > 64 << 10  # torch's own file, byte for byte
    got = torch.load(path, weights_only=True, mmap=mmap)
    assert_bit_equal(obj, got)
    assert got["rows"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]


def test_written_with_o_direct_and_truncated(tmp_path, backend, monkeypatch):
    opened = []

    def spy(path, write, direct=True):
        fd, is_direct = open_file(path, write, direct)
        opened.append((path, is_direct, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return fd, is_direct

    open_file = _torchfile.open_file
    monkeypatch.setattr(_torchfile, "open_file", spy)
    w = TorchFileWriter(SMALL)
    path = str(tmp_path / "d.ckpt")
    w.save({"x": torch.arange(12345, dtype=torch.int16)}, path).wait()
    w.close()
    assert opened == [(f"{path}.{os.getpid()}.tmp", True, True)]
    assert os.path.getsize(path) % 4096 and torch.equal(torch.load(path)["x"], torch.arange(12345, dtype=torch.int16))


class FlakyBackend:
    """The real backend, but the ``fail_at``-th write fails with ENOSPC and each write may wait on ``gate``."""

    def __init__(self, real, fail_at=None, gate=None):
        self.real, self.fail_at, self.gate, self.n = real, fail_at, gate, 0

    def write(self, fd, buf, offset, token, path=None):
        if self.gate is not None:
            self.gate.wait()
        self.n += 1
        if self.n == self.fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        self.real.write(fd, buf, offset, token, path)

    def __getattr__(self, name):
        return getattr(self.real, name)


def flaky(monkeypatch, **kw):
    monkeypatch.setattr(_torchfile, "make_backend", lambda *a: FlakyBackend(REAL_BACKEND(*a), **kw))


def test_torn_write_keeps_the_previous_file_and_raises_once(tmp_path, backend, monkeypatch):
    from lightning_layerckpt import LayerCheckpointIO

    io_ = LayerCheckpointIO(SMALL)
    path = str(tmp_path / "t.ckpt")
    io_.save_checkpoint({"v": torch.zeros(5000)}, path)
    io_.wait()
    flaky(monkeypatch, fail_at=3)
    io_.save_checkpoint({"v": torch.ones(5000)}, path)  # fails in the background, after two chunks
    io_._writer.wait_for(path, check=False)
    with pytest.raises(layerckpt.CheckpointWriteError, match="No space left") as e:
        io_.save_checkpoint({"v": torch.ones(5000)}, str(tmp_path / "u.ckpt"))  # the next save raises it
    assert e.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["t.ckpt"]  # no temporary file, the old file intact
    assert torch.equal(torch.load(path, weights_only=True)["v"], torch.zeros(5000))
    io_.wait()  # raised once
    flaky(monkeypatch, fail_at=1)
    io_.save_checkpoint({"v": torch.ones(5000)}, path)
    with pytest.raises(layerckpt.CheckpointWriteError):
        io_.teardown()  # teardown raises it too, and leaves no thread
    assert not [t for t in threading.enumerate() if t.name.startswith("layerckpt")]
    with pytest.raises(TypeError, match="storage_options"):
        io_.save_checkpoint({}, path, storage_options={"a": 1})


def test_a_failed_stage_writes_nothing(tmp_path):
    w = TorchFileWriter(SMALL)
    with pytest.raises(Exception):
        w.save({"ok": torch.ones(10000), "bad": threading.Lock()}, str(tmp_path / "x.ckpt"))  # not picklable
    w.close()
    assert os.listdir(tmp_path) == [] and not [t for t in threading.enumerate() if t.name.startswith("layerckpt")]


def test_read_your_writes_and_remove_while_writing(tmp_path, monkeypatch):
    from lightning_layerckpt import LayerCheckpointIO

    gate = threading.Event()
    flaky(monkeypatch, gate=gate)
    io_ = LayerCheckpointIO(SMALL.replace(staging_bytes="1MiB"))  # room for all three while the writes wait
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io_.save_checkpoint({"v": torch.zeros(3000)}, a)
    io_.save_checkpoint({"v": torch.ones(3000)}, a)  # the same path again: lands after the first
    io_.save_checkpoint({"v": torch.full((3000,), 2.0)}, b)
    assert not os.path.exists(a) and not os.path.exists(b)  # still in flight
    threading.Timer(0.05, gate.set).start()
    assert torch.equal(io_.load_checkpoint(a)["v"], torch.ones(3000))
    io_.remove_checkpoint(b)  # waits for its write, then removes it
    io_.teardown()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]


class NoSkip:
    """Pickles only when storage bytes are written (as torch's XLA tensors under skip_data())."""

    def __init__(self, t):
        self.t = t

    def __reduce__(self):
        if torch.serialization._serialization_tls.skip_data:
            raise RuntimeError("needs its bytes")
        return NoSkip, (self.t,)


def test_objects_it_cannot_lay_out_are_written_by_torch_save(tmp_path):
    w = TorchFileWriter(SMALL)
    obj = {"odd": NoSkip(torch.arange(10)), "x": torch.arange(100.0), "meta": torch.empty(4, 4, device="meta")}
    p = w.save(obj, str(tmp_path / "m.ckpt"))
    assert p.done() and p.nbytes == 0  # written on the calling thread, durable on return
    w.close()
    got = torch.load(str(tmp_path / "m.ckpt"), weights_only=False)
    assert torch.equal(got["odd"].t, torch.arange(10)) and torch.equal(got["x"], obj["x"]) and got["meta"].is_meta
    assert os.listdir(tmp_path) == ["m.ckpt"]


# ------------------------------------------------------------------ a real Lightning Trainer

def test_trainer_save_checkpoint_then_load_anywhere(tmp_path):
    import lightning  # noqa: F401
    from lit_helpers import Tiny, trainer
    from lightning_layerckpt import LayerCheckpointIO

    torch.manual_seed(7)
    m = Tiny()
    t = trainer(3, [], str(tmp_path), plugins=[LayerCheckpointIO()], enable_checkpointing=False)
    t.fit(m)
    p = str(tmp_path / "final.ckpt")
    t.save_checkpoint(p)
    loaded = type(m).load_from_checkpoint(p)  # at once: after fit, the save returned once durable
    assert_bit_equal(m.state_dict(), loaded.state_dict())
    raw = torch.load(p, weights_only=True)
    assert raw["global_step"] == 3 and raw["hyper_parameters"]["n_embd"] == 32
    assert_bit_equal(dict(m.state_dict()), dict(raw["state_dict"]))
    m2 = Tiny(seed=5)
    t2 = trainer(3, [], str(tmp_path), plugins=[LayerCheckpointIO()], enable_checkpointing=False)
    t2.fit(m2, ckpt_path=p)  # already at max_steps: restores, trains no further
    assert t2.global_step == 3
    assert_bit_equal(m.state_dict(), m2.state_dict())
    assert_same_optimizer_state(t.optimizers[0].state_dict(), t2.optimizers[0].state_dict())
    assert not [th for th in threading.enumerate() if th.name.startswith("layerckpt")]


def test_model_checkpoint_top_k_keeps_the_right_files(tmp_path):
    import lightning  # noqa: F401
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lit_helpers import Tiny, trainer
    from lightning_layerckpt import LayerCheckpointIO

    torch.manual_seed(7)
    d = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(d), save_top_k=2, monitor="loss", every_n_train_steps=1,
                         filename="{step}")
    t = trainer(6, [mc], str(tmp_path), plugins=[LayerCheckpointIO(SMALL)])
    t.fit(Tiny())
    assert sorted(os.listdir(d)) == sorted(os.path.basename(k) for k in mc.best_k_models) and len(mc.best_k_models) == 2
    for k in mc.best_k_models:
        assert torch.load(k, weights_only=True)["global_step"] == int(os.path.basename(k)[5:-5])
    assert not [th for th in threading.enumerate() if th.name.startswith("layerckpt")]


def test_bench_lightning_tiny(tmp_path, capsys):
    """`layerckpt bench --lightning` end to end (tiny size, one repeat: a smoke test, not a measurement)."""
    import lightning  # noqa: F401
    import json

    from layerckpt.cli import main

    assert main(["bench", "--lightning", "--size", "tiny", "--reps", "1", "--dir", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res["runs"]) == {"LayerCheckpointIO", "TorchCheckpointIO", "AsyncCheckpointIO"} and res["bit_exact"]
    assert all(len(r["blocked"]) == 1 and r["durable"][0] >= r["blocked"][0] > 0 for r in res["runs"].values())
    assert res["reference"]["write_s"] > 0 and res["reference"]["memcpy_s"] > 0 and res["machine"]["cores"]
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself
    assert not [th for th in threading.enumerate() if th.name.startswith("layerckpt")]
