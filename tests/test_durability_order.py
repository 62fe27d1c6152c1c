"""The commit's order, seen in the real system calls (``strace``): no manifest is renamed into place before every
byte it names is durable. For each rename of a manifest into ``manifests/``: each data file it names was synced
(fdatasync or fsync) after its last write and its name's folder (``data/``) synced after the file got that name;
the manifest's own temporary file synced after its last write; and the ``manifests/`` folder synced after the
rename. A data sync moved after the publication, a skipped folder sync or an unsynced manifest fails here."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import require_uring

pytestmark = pytest.mark.skipif(shutil.which("strace") is None or not sys.platform.startswith("linux"),
                                reason="needs strace (Linux)")

JOB = r"""
import sys, torch, layerckpt
sys.path.insert(0, sys.argv[2])
from conftest import small_model, train_steps
model = small_model(0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
train_steps(model, opt, 1)
cfg = layerckpt.Config(keep_last=10, **eval(sys.argv[3]))
with layerckpt.Checkpointer(sys.argv[1], model, opt, config=cfg) as ck:
    for step in range(1, 5):
        train_steps(model, opt, 1, seed=step)
        ck.save(step).wait()
"""

SYSCALLS = "write,pwrite64,pwritev,pwritev2,fsync,fdatasync,rename,renameat,renameat2,io_uring_enter,ftruncate"
LINE = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+)")
FD_PATH = re.compile(r"^-?\d+<(.*?)>")
STR = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _trace(root, backend: str, config: str, tmp_path):
    log = tmp_path / f"strace-{backend}.log"
    env = {**os.environ, "LAYERCKPT_BACKEND": backend}
    r = subprocess.run(["strace", "-f", "--seccomp-bpf", "-y", "-qq", "-e", f"trace={SYSCALLS}", "-o", str(log), sys.executable,
                        "-c", JOB, str(root), os.path.dirname(__file__), config],
                       capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stdout + r.stderr
    return log.read_text().splitlines()


def _events(lines):
    """(call, fd's path or None, [string arguments]) of each successful call, in the order they returned (a call
    that another thread's interrupted in the log, ``<unfinished ...>``, counts where it is ``resumed``)."""
    out, started = [], {}
    for line in lines:
        pid, _, rest = line.partition(" ")
        if rest.endswith("<unfinished ...>"):
            started[pid] = rest[: -len("<unfinished ...>")].rstrip()
            continue
        resumed = re.match(r"<\.\.\. (\w+) resumed>(.*)$", rest.strip())
        if resumed and pid in started:
            line = f"{pid} {started.pop(pid)}{resumed.group(2)}"
        m = LINE.match(line)
        if not m or int(m.group(4)) < 0:
            continue
        call, args = m.group(2), m.group(3)
        fd = FD_PATH.match(args)
        out.append((call, fd.group(1) if fd else None, STR.findall(args) if call.startswith("rename") else []))
    return out


def check_order(root: str, lines) -> int:
    """The violations of the commit's order in a trace (raises AssertionError listing them); returns how many
    manifests were checked."""
    root = os.path.realpath(root)
    ident, files = {}, {}  # path -> file id (follows renames); id -> {"write": i, "sync": i, "named": i}
    synced_dir = {}  # folder -> index of its last sync

    def fid(path):
        if path not in ident:
            ident[path] = len(files)
            files[ident[path]] = {"write": -1, "sync": -1, "named": -1}
        return ident[path]

    bad, checked, events = [], 0, _events(lines)
    for i, (call, path, names) in enumerate(events):
        if call in ("write", "pwrite64", "pwritev", "pwritev2", "ftruncate") and path and path.startswith(root):
            files[fid(path)]["write"] = i
        elif call in ("fsync", "fdatasync") and path and path.startswith(root):
            if os.path.isdir(path) or path.endswith(("/data", "/manifests")) or path == root:
                synced_dir[path] = i
            else:
                files[fid(path)]["sync"] = i
        elif call.startswith("rename") and len(names) == 2:
            src, dst = (os.path.join(root, n) if not os.path.isabs(n) else n for n in names)
            if not dst.startswith(root):
                continue
            ident[dst] = fid(src)
            ident.pop(src, None)
            files[ident[dst]]["named"] = i
            if "/manifests/" not in dst or not dst.endswith(".json"):
                continue
            checked += 1
            f = files[ident[dst]]
            if not f["write"] < f["sync"] < i:
                bad.append(f"{dst}: renamed into place before its own bytes were synced ({f})")
            with open(dst, encoding="utf-8") as fh:
                named = json.load(fh)["files"]
            for name in named:
                data = os.path.join(root, "data", name) if "/" not in name else os.path.join(root, name)
                d = files.get(ident.get(data, -1))
                if d is None or not d["write"] < d["sync"] < i:
                    bad.append(f"{os.path.basename(dst)} was renamed into place (call {i}) before {name} was "
                               f"synced after its last write ({d})")
                    continue
                folder = synced_dir.get(os.path.dirname(data), -1)
                if not max(d["named"], 0) < folder < i:
                    bad.append(f"{os.path.basename(dst)} was renamed into place (call {i}) before the folder of "
                               f"{name} was synced after the file got its name (folder synced at {folder})")
            folder = os.path.dirname(dst)
            if not any(c in ("fsync", "fdatasync") and p == folder for c, p, _ in events[i + 1:]):
                bad.append(f"{folder} was never synced after the rename of call {i}")
    assert checked, "no manifest rename was seen: the trace did not record the commit"
    assert not bad, "\n".join(bad)
    return checked


@pytest.mark.parametrize("backend", ["threads", "uring"])
@pytest.mark.parametrize("config", ["{'threshold': 0.0}", "{}"], ids=["full", "default"])
def test_no_manifest_is_renamed_into_place_before_what_it_names_is_durable(tmp_path, backend, config):
    if backend == "uring":
        require_uring("the uring backend's commit order")
    root = tmp_path / "ck"
    lines = _trace(root, backend, config, tmp_path)
    assert check_order(str(root), lines) == 4


def test_the_check_fails_on_a_data_sync_after_the_publication(tmp_path):
    """The check itself, on a trace whose data file is synced only after the manifest's rename (the planted bug
    the test above is for): it must say so."""
    root = tmp_path / "ck"
    (root / "manifests").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "manifests" / "step-00000001.json").write_text(json.dumps({"files": {"step-00000001.rank0.safetensors": {}}}))
    r = str(root)
    data = f"{r}/data/step-00000001.rank0.safetensors"
    good = [f'1 pwrite64(5<{data}>, "..."..., 4096, 0) = 4096',
            f"1 fdatasync(5<{data}>) = 0",
            f"1 fsync(6<{r}/data>) = 0",
            f'1 write(7<{r}/manifests/step-00000001.json.tmp>, "{{"..., 10) = 10',
            f"1 fsync(7<{r}/manifests/step-00000001.json.tmp>) = 0",
            f'1 rename("{r}/manifests/step-00000001.json.tmp", "{r}/manifests/step-00000001.json") = 0',
            f"1 fsync(8<{r}/manifests>) = 0"]
    assert check_order(r, good) == 1
    interleaved = [good[0], f"2 fdatasync(5<{data}> <unfinished ...>", f"3 fsync(6<{r}/data>) = 0",
                   "2 <... fdatasync resumed>) = 0", *good[2:]]  # another thread's call logged inside the sync
    assert check_order(r, interleaved) == 1
    with pytest.raises(AssertionError, match="before step-00000001.rank0.safetensors was synced"):
        check_order(r, [*interleaved[:2], *good[2:6], interleaved[3], good[6]])  # it returned after the rename
    late = [good[0], good[2], good[3], good[4], good[5], good[1], good[6]]  # the data's sync after the rename
    with pytest.raises(AssertionError, match="before step-00000001.rank0.safetensors was synced"):
        check_order(r, late)
    no_dir = [x for x in good if f"{r}/data>" not in x]
    with pytest.raises(AssertionError, match="before the folder of"):
        check_order(r, no_dir)
    with pytest.raises(AssertionError, match="manifests was never synced after the rename"):
        check_order(r, good[:-1])
    unsynced = [x for x in good if ".json.tmp>) = 0" not in x or "write" in x]
    with pytest.raises(AssertionError, match="before its own bytes were synced"):
        check_order(r, unsynced)
