"""The native ring and the threads backend, through the one backend interface."""
import errno
import mmap
import os
import resource
import subprocess
import sys

import pytest
import torch

import layerckpt
from layerckpt.io import _backend as B
from conftest import require_native, require_uring

pytestmark = pytest.mark.usefixtures("backend")


def _aligned(n: int, fill: bytes) -> mmap.mmap:
    m = mmap.mmap(-1, n)
    m.write((fill * (n // len(fill) + 1))[:n])
    return m


def test_write_read_roundtrip_odirect(tmp_path, backend):
    be = B.make_backend("auto", depth=4)
    assert be.name == backend
    path = str(tmp_path / "f.bin")
    bufs = [_aligned(1 << 20, bytes([i]) * 4099) for i in range(6)]
    be.register_buffers([memoryview(b) for b in bufs])
    fd, direct = B.open_file(path, write=True)
    assert direct, "ext4 and tmpfs here accept O_DIRECT"
    for i, b in enumerate(bufs):  # more requests than the queue depth
        be.write(fd, memoryview(b), i << 20, i, path)
    done = be.drain()
    assert sorted(done) == list(range(6))
    os.fdatasync(fd)
    os.close(fd)
    assert os.path.getsize(path) == 6 << 20
    fd, _ = B.open_file(path, write=False)
    out = mmap.mmap(-1, 6 << 20)
    view = memoryview(out)
    for i in range(6):
        be.read(fd, view[i << 20:(i + 1) << 20], i << 20, ("r", i), path)
    assert len(be.drain()) == 6
    os.close(fd)
    assert out[:] == b"".join(b[:] for b in bufs)
    view.release()
    be.close()


def test_read_stops_at_eof(tmp_path, backend):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 5000)
    be = B.make_backend("auto", depth=2)
    fd, _ = B.open_file(str(path), write=False)
    buf = mmap.mmap(-1, 8192)
    be.read(fd, memoryview(buf), 0, "t", str(path))
    assert be.drain() == ["t"]
    assert buf[:5000] == b"x" * 5000 and buf[5000:] == bytes(3192)
    os.close(fd)
    be.close()


def test_error_carries_errno_and_path(tmp_path, backend):
    path = str(tmp_path / "ro.bin")
    open(path, "wb").close()
    fd = os.open(path, os.O_RDONLY)  # writing to a read-only fd: EBADF
    be = B.make_backend("auto", depth=2)
    buf = _aligned(4096, b"a")
    be.write(fd, memoryview(buf), 0, "t1", path)
    with pytest.raises(OSError) as ei:
        be.drain()
    assert ei.value.errno == errno.EBADF
    assert ei.value.filename == path
    # the backend is usable again after an error
    fd2, _ = B.open_file(str(tmp_path / "ok.bin"), write=True)
    be.write(fd2, memoryview(buf), 0, "t2", path)
    assert be.drain() == ["t2"]
    os.close(fd)
    os.close(fd2)
    be.close()


def test_env_forces_backend(monkeypatch):
    monkeypatch.setenv("LAYERCKPT_BACKEND", "threads")
    assert B.make_backend("uring").name == "threads"
    monkeypatch.setenv("LAYERCKPT_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="LAYERCKPT_BACKEND"):
        B.make_backend()


def test_crc32c_known_vectors_and_continuation():
    require_native("the native CRC32C")
    crc = B._uring.crc32c
    assert crc(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc(b"") == 0
    data = os.urandom(3 * 4096 * 5 + 77)  # crosses the 3-stream blocks and an odd tail
    assert crc(data) == crc(data[1000:], crc(data[:1000]))
    assert crc(memoryview(data)[3:]) == crc(data[3:])


def test_ring_fixed_buffers_registered(tmp_path):
    require_uring("the ring's registered buffers")
    be = B.UringBackend(2)
    bufs = [memoryview(mmap.mmap(-1, 1 << 16)) for _ in range(3)]
    be.register_buffers(bufs)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    can_lock = os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= 4 * (1 << 16)
    assert be.registered == (3 if can_lock else 0)
    path = str(tmp_path / "fx.bin")
    fd, _ = B.open_file(path, write=True)
    be.write(fd, bufs[1][:8192], 0, "a", path)  # a slice of a registered buffer
    assert be.drain() == ["a"]
    os.close(fd)
    be.close()


UNPRIVILEGED = r"""
import logging, mmap, os, resource, sys
import layerckpt  # everything imported while the files under /root are still readable
from layerckpt.io import _backend as B
assert B.uring_available() is None
path = os.path.join(sys.argv[1], "f.bin")
fd, _ = B.open_file(path, write=True)  # opened before dropping: nobody cannot reach root's temp dir
logging.basicConfig(level=logging.WARNING)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 16, 1 << 16))
os.setgid(65534); os.setuid(65534)  # nobody: RLIMIT_MEMLOCK now binds
be = B.UringBackend(2)
bufs = [memoryview(mmap.mmap(-1, 1 << 20)) for _ in range(3)]
be.register_buffers(bufs)
be.write(fd, bufs[0][:8192], 0, "a", path)
print("REGISTERED", be.registered, "DONE", be.drain())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")
def test_registration_refused_under_memlock_is_logged_and_io_goes_on(tmp_path):
    require_uring("buffer registration under RLIMIT_MEMLOCK")
    r = subprocess.run([sys.executable, "-c", UNPRIVILEGED, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "REGISTERED 0 DONE ['a']" in r.stdout
    assert "io_uring buffer registration refused" in r.stderr


NO_NATIVE = r"""
import sys
sys.modules["layerckpt.io._uring"] = None  # as on a machine where the extension was not built
import torch, layerckpt
from layerckpt.io import _backend
assert _backend._uring is None and _backend.CHECKSUM == "crc32"
model = torch.nn.Linear(64, 64)
out = layerckpt.restore(sys.argv[1], model)
print("RESTORED", out.step, bool((model.weight == 2.0).all()))
from layerckpt.cli import main
sys.exit(main(["verify", sys.argv[1]]))
"""


def test_checkpoints_stay_verifiable_without_the_native_module(tmp_path):
    from layerckpt.io._crc32c import crc32c

    data = os.urandom(1 << 20 | 77)
    assert crc32c(data) == B.checksum(data) == crc32c(data[5000:], crc32c(data[:5000]))  # the same values
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(2.0)
    with layerckpt.Checkpointer(tmp_path, model, config=layerckpt.Config(threshold=0.0)) as ck:
        ck.save(1).wait()
    r = subprocess.run([sys.executable, "-c", NO_NATIVE, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LAYERCKPT_BACKEND": "threads"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RESTORED 1 True" in r.stdout and "1 of 1 checkpoint(s) verified" in r.stdout


def test_the_commit_keeps_every_field_of_an_entry_but_seals_its_crc():
    """``merge`` builds each committed entry anew from the rank's: every field of TensorEntry must come through."""
    import dataclasses

    from layerckpt.format._manifest import Manifest, TensorEntry
    from layerckpt.format._places import seal
    from layerckpt.write._commit import RankResult, merge

    names = [f.name for f in dataclasses.fields(TensorEntry)]
    assert names == ["file", "dtype", "shape", "offset", "nbytes", "crc", "enc"]  # a new field: build it in merge
    e = TensorEntry(file="f.safetensors", dtype="F32", shape=[2, 3], offset=4096, nbytes=24, crc=0x1234,
                    enc={"codec": "zstd", "blocks": [[4096, 10, 24, 1]], "ref": None})
    m = Manifest(step=7, seq=1, world_size=1, created=0.0, config={}, files={}, tensors={}, layers={},
                 model=None, optimizer=None, rng=None, extra=None)
    merge(m, [RankResult(0, "f.safetensors", 8192, None, tensors={"model/w": e})], "crc32c")
    got = m.tensors["model/w"]
    check = B.checksum_function("crc32c")
    assert got is not e and got.crc == seal(check, "model/w", 0x1234, 7)
    assert {n: getattr(got, n) for n in names if n != "crc"} == {n: getattr(e, n) for n in names if n != "crc"}
