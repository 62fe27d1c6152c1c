"""layerckpt plot / layerckpt.plot: a figure of a store's history from its manifests alone."""
import json
import subprocess
import sys

import pytest
import torch

import layerckpt
from layerckpt import _plot, cli
from layerckpt.bench.workload import make_model, make_optimizer, start_finetune, train_step

PNG = b"\x89PNG\r\n\x1a\n"


def selective_store(root, saves=6, n_layer=4, config=None):
    """A fine-tuning run with a selective checkpoint every 2 steps (the loss given: fidelity decides)."""
    model = make_model(0, n_layer=n_layer, n_embd=32)
    opt = make_optimizer(model)
    for s in range(20):
        train_step(model, opt, "count", s)
    start_finetune(opt)
    cfg = config or layerckpt.Config(keep_last=0, max_staleness=4, encoding="delta")  # stored bytes differ from raw
    with layerckpt.Checkpointer(root, model, opt, config=cfg) as ck:
        for k in range(saves):
            for s in range(2):
                loss = train_step(model, opt, "affine", 2 * k + s)
            ck.save(2 * k + 2, loss=loss).wait()
            ck.wait()  # every tier too: a remote tier busy with one composite would skip to the newest
    return model


def test_history_is_read_from_the_manifests(tmp_path):
    root = tmp_path / "ck"
    model = selective_store(root)
    h = _plot.history(str(root))
    good, _ = layerckpt.format._store.read_all(str(root))
    ms = sorted(good.values(), key=lambda m: m.seq)
    assert h.steps == [m.step for m in ms] == [2, 4, 6, 8, 10, 12]
    assert h.layers == list(ms[0].layers) and len(h.layers) == 4 + 3  # blocks, wte (tied head), wpe, ln_f
    assert (h.state[:, 0] == 1).all()  # the first checkpoint writes every layer
    for j, m in enumerate(ms):
        for i, name in enumerate(h.layers):
            e = m.layers[name]
            assert h.behind[i, j] == m.step - e.step
            assert h.state[i, j] == (1 if e.step == m.step else 2 if e.unchanged else 3)
        mine = [e for e in m.tensors.values() if m.files[e.file].step == m.step]
        assert h.raw[j] == sum(e.nbytes for e in mine) and h.stored[j] == sum(_plot.stored_bytes(e) for e in mine)
        assert h.full[j] == sum(e.nbytes for e in m.tensors.values())
        assert h.loss_increase[j] == m.loss_increase
    assert h.raw[0] == h.full[0] and min(h.raw[1:]) < h.full[0]  # later saves are selective
    assert (h.state == 3).any() and h.stored[0] < h.raw[0]  # something skipped; delta/compressed bytes


def test_many_layers_are_aggregated_into_rows(tmp_path):
    root = tmp_path / "ck"
    selective_store(root, saves=3, n_layer=12)
    h = _plot.history(str(root))
    img, spans = _plot.colors(h, max_rows=5)
    assert img.shape == (5, 3, 3) and spans[0][0] == 0 and spans[-1][1] == len(h.layers)
    assert all(b > a for a, b in spans)
    full, _ = _plot.colors(h, max_rows=1000)
    assert full.shape[0] == len(h.layers)
    assert torch.allclose(torch.tensor(img[0, 0]), torch.tensor(full[spans[0][0]:spans[0][1], 0].mean(axis=0)))


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    selective_store(root, saves=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r'pip install "layerckpt\[plot\]"'):
        layerckpt.plot(root)
    assert cli.main(["plot", str(root), "-o", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def test_cli_refuses_bad_outputs(tmp_path, capsys):
    root = tmp_path / "ck"
    selective_store(root, saves=1)
    assert cli.main(["plot", str(root), "-o", str(tmp_path / "x.gif")]) == 2
    assert "name a .png, .svg or .pdf" in capsys.readouterr().err
    assert cli.main(["plot", str(root), "-o", str(tmp_path / "no" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "none"), "-o", str(tmp_path / "x.png")]) == 2


def test_plot_writes_a_real_png_of_a_local_store(tmp_path):
    import matplotlib  # noqa: F401
    root = tmp_path / "ck"
    selective_store(root)
    out = tmp_path / "history.png"
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "plot", str(root), "-o", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "7 layers x 6 checkpoints (steps 2..12)" in r.stdout
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    fig = layerckpt.plot(root)
    heat, nbytes, loss = fig.axes[:3]
    assert [t.get_text() for t in heat.get_xticklabels()] == ["2", "4", "6", "8", "10", "12"]
    assert len(nbytes.patches) == 12  # raw and stored bars of each checkpoint
    assert len(loss.lines) == 1 and len(loss.lines[0].get_xdata()) == 6
    fig.savefig(tmp_path / "h.svg")
    assert b"<svg" in (tmp_path / "h.svg").read_bytes()[:400]


def test_plot_reads_a_remote_store(s3, tmp_path):
    import matplotlib  # noqa: F401
    url, options = f"s3://{s3.bucket()}/plot", s3.options
    selective_store(tmp_path / "ck", saves=3, config=layerckpt.Config(keep_last=0, remote=url, remote_options=options))
    out = tmp_path / "remote.png"
    assert cli.main(["plot", url, "-o", str(out), "--remote-options", json.dumps(options)]) == 0
    assert out.read_bytes()[:8] == PNG
    fig = layerckpt.plot(url, config=layerckpt.Config(remote=url, remote_options=options))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["2", "4", "6"]
    assert fig.get_suptitle() == url
