"""Progress bars of the long commands: drawn on a terminal (a pseudo-terminal here), never in a pipe, nor with
--quiet, nor by library calls."""
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
import torch

import layerckpt
from layerckpt import _progress, cli as cli_module
from layerckpt.format import _store
from conftest import small_model, trained

import tqdm  # noqa: F401


def run_on_terminal(*args):
    """(exit code, stdout, what the terminal on stderr showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns, as a terminal has
    p = subprocess.Popen([sys.executable, "-m", "layerckpt.cli", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer of the terminal is gone
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    out = p.stdout.read().decode()
    return p.wait(timeout=120), out, shown.decode(errors="replace")


def run_in_pipe(*args):
    return subprocess.run([sys.executable, "-m", "layerckpt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def store(tmp_path):
    model, opt = trained()
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(keep_last=0)) as ck:
        ck.save(10).wait()
        ck.save(20).wait()
    return root


def test_verify_and_export_draw_a_bar_on_a_terminal_only(store, tmp_path):
    code, out, shown = run_on_terminal("verify", store)
    assert code == 0 and "2 of 2 checkpoint(s) verified" in out
    assert re.search(r"verify: .*B/s", shown), shown  # bytes and rate
    assert max(len(line) for line in shown.split("\r")) <= 120  # the terminal's width, from stderr
    total = sum(cli_module._stored_total(m) for m in _store.read_all(str(store))[0].values())
    assert re.search(r"verify: .*\| *[0-9.]+[kMG]?/" + _size(total) + " ", shown), shown  # of all of it, as stored

    piped = run_in_pipe("verify", store)
    assert piped.returncode == 0 and piped.stderr == "" and "verify:" not in piped.stdout

    code, out, shown = run_on_terminal("verify", "--quiet", store)
    assert code == 0 and shown == "" and "2 of 2" in out

    code, out, shown = run_on_terminal("export", store, "-o", tmp_path / "m.safetensors")
    assert code == 0 and "wrote" in out
    assert "export (read):" in shown and "export (write):" in shown

    piped = run_in_pipe("export", store, "-o", tmp_path / "m2.safetensors")
    assert piped.returncode == 0 and piped.stderr == ""
    # the same tensors and metadata (not the same bytes: safetensors writes its metadata map in any order)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m.safetensors"), "pt") as a, safe_open(str(tmp_path / "m2.safetensors"), "pt") as b:
        assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def _size(n):
    """tqdm's way of writing ``n`` bytes with unit_scale and unit_divisor=1024."""
    from tqdm import tqdm

    return re.escape(tqdm.format_sizeof(n, divisor=1024))


def test_verify_reads_in_batches_and_still_names_damage(store, monkeypatch, capsys):
    monkeypatch.setattr(cli_module, "_BATCH_BYTES", 4096)  # many reads per checkpoint
    seen = []
    monkeypatch.setattr(_progress, "wanted", lambda quiet=False: True)
    monkeypatch.setattr(_progress.Bar, "update", lambda self, n: seen.append(n))
    assert cli_module.main(["verify", str(store)]) == 0
    good = _store.read_all(str(store))[0]
    assert sum(seen) == sum(cli_module._stored_total(m) for m in good.values()) and len(seen) > 4
    assert "2 of 2 checkpoint(s) verified" in capsys.readouterr().out


def test_library_calls_stay_silent_on_a_terminal(store, monkeypatch, capsys):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    model = small_model(3)
    layerckpt.restore(store, model)
    layerckpt.read_checkpoint(store)
    assert err.getvalue() == ""


def test_bar_is_a_no_op_when_not_shown(tmp_path):
    with _progress.Bar(100, "x", shown=False) as bar:
        bar.update(50)
        bar.set(70)
    with _progress.watching(lambda: 5, None, "x", shown=False) as bar:
        bar.update(1)
    assert _progress.wanted(quiet=True) is False
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 10)
    assert _progress.size_of(str(tmp_path / "d")) == 10 and _progress.size_of(str(tmp_path / "none")) == 0


def test_bench_shows_its_disk_traffic_on_a_terminal_and_keeps_its_report_readable(tmp_path):
    args = ("bench", "--preset", "tiny", "--reps", "1", "--only", "layerckpt", "--dir", tmp_path)
    code, out, shown = run_on_terminal(*args)
    assert code == 0 and "restore bit-exact: True" in out
    assert re.search(r"bench run I/O: .*B/s", shown), shown
    piped = run_in_pipe(*args, "--json")
    assert piped.returncode == 0 and "bench run I/O" not in piped.stderr + piped.stdout
    code, out, shown = run_on_terminal(*args, "--quiet")
    assert code == 0 and "bench run I/O" not in shown
