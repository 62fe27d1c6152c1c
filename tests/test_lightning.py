"""The Lightning adapter on real Trainers: save, crash, resume in a new Trainer, compare with the run that never stopped."""
import csv
import gc
import glob
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import lightning  # noqa: F401
import lightning.pytorch as L  # noqa: E402
from lightning.fabric.utilities.exceptions import MisconfigurationException  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import layerckpt  # noqa: E402
from layerckpt.format import _store as store  # noqa: E402
from lightning_layerckpt import LayerCheckpoint, LayerCheckpointIO  # noqa: E402
from layerckpt.bench.lightning_workload import FineTuneModule  # noqa: E402
from conftest import assert_same_optimizer_state, assert_same_tensors  # noqa: E402
from lit_helpers import Crash, CrashAt, Tiny, pretrained, state_of, trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def assert_same(a: dict, b: dict) -> None:
    assert_same_tensors(a["model"], b["model"])
    assert_same_optimizer_state(a["optimizer"], b["optimizer"])
    assert a["scheduler"] == b["scheduler"]
    assert a["global_step"] == b["global_step"] and a["epoch"] == b["epoch"]
    assert a["loops"] == b["loops"]


def reference(tmp_path, steps=20, finetune=False, **kw):
    torch.manual_seed(7)
    m = pretrained(Tiny(task="affine", lr=3e-4, **kw)) if finetune else Tiny(**kw)
    t = trainer(steps, [LayerCheckpoint(dirpath=str(tmp_path / "ref"), every_n_train_steps=4, threshold=0.0)],
                str(tmp_path))
    t.fit(m)
    return t, m


def crashed_then_resumed(tmp_path, crash_at=14, steps=20, ckpt_path="last", finetune=False, model=None, **cb):
    d = str(tmp_path / "run")
    mk = dict(model or {}, **({"task": "affine", "lr": 3e-4} if finetune else {}))
    torch.manual_seed(7)
    m = pretrained(Tiny(**mk)) if finetune else Tiny(**mk)
    t = trainer(steps, [LayerCheckpoint(dirpath=d, every_n_train_steps=4, **cb), CrashAt(crash_at)], str(tmp_path))
    with pytest.raises(Crash):
        t.fit(m)
    # the exception's teardown waited for the flush in flight: the last save before the crash is committed
    assert layerckpt.read_checkpoint(d).step == (crash_at // 4) * 4
    torch.manual_seed(123)  # a new process would start from other RNG states and other weights
    m2 = Tiny(seed=5, **mk)
    cb2 = LayerCheckpoint(dirpath=d, every_n_train_steps=4, **cb)
    t2 = trainer(steps, [cb2], str(tmp_path))
    t2.fit(m2, ckpt_path=ckpt_path(d) if callable(ckpt_path) else ckpt_path)
    return t2, m2, cb2


def test_resume_is_bit_exact_with_threshold_zero(tmp_path):
    t, m = reference(tmp_path)
    t2, m2, cb = crashed_then_resumed(tmp_path, threshold=0.0)
    assert cb.restored["step"] == 12 and cb.restored["max_staleness"] == 0
    assert_same(state_of(t, m), state_of(t2, m2))
    assert m.losses[12:] == m2.losses  # dropout draws too: each RNG came back as it was at the save


def test_resume_from_the_remote_tier_when_the_local_store_is_gone(tmp_path):
    """LayerCheckpoint(remote=URL): the node dies with its disk; "last" finds the remote tier's newest
    composite and the resume is bit for bit."""
    import shutil

    t, m = reference(tmp_path)
    remote, d = (tmp_path / "remote").as_uri(), str(tmp_path / "run")
    torch.manual_seed(7)
    with pytest.raises(Crash):
        trainer(20, [LayerCheckpoint(dirpath=d, every_n_train_steps=4, threshold=0.0, remote=remote),
                     CrashAt(14)], str(tmp_path)).fit(Tiny())
    shutil.rmtree(d)
    torch.manual_seed(123)
    m2 = Tiny(seed=5)
    cb2 = LayerCheckpoint(dirpath=d, every_n_train_steps=4, threshold=0.0, remote=remote)
    t2 = trainer(20, [cb2], str(tmp_path))
    t2.fit(m2, ckpt_path="last")
    assert cb2.restored["step"] == 12
    assert_same(state_of(t, m), state_of(t2, m2))
    assert m.losses[12:] == m2.losses


def test_url_dirpath_stages_locally_and_resumes_from_s3(s3, tmp_path):
    """LayerCheckpoint(dirpath="s3://..."): saves staged in a local directory under default_root_dir and copied
    to the bucket; on another machine (a new root, the first one gone) "last" resumes from S3, bit for bit."""
    import shutil

    from lightning_layerckpt.callback import staging_dir_for

    t, m = reference(tmp_path)
    url = f"s3://{s3.bucket()}/run"
    cb = dict(every_n_train_steps=4, threshold=0.0, remote_options=s3.options)
    first, second = tmp_path / "node1", tmp_path / "node2"
    torch.manual_seed(7)
    c1 = LayerCheckpoint(dirpath=url, **cb)
    assert c1.layer_config.remote == url and c1.dirpath is None
    with pytest.raises(Crash):
        trainer(20, [c1, CrashAt(14)], str(first)).fit(Tiny())
    staged = staging_dir_for(url, first)
    assert c1.dirpath == staged and os.path.dirname(staged) == str(first / "layerckpt-staging")
    assert os.path.basename(staged).startswith(url.split("://")[1].replace("/", "-") + "-")
    assert sorted(os.listdir(os.path.join(staged, "manifests"))) == ["step-00000008.json", "step-00000012.json"]
    assert c1.last_model_path == os.path.join(staged, "manifests", "step-00000012.json")
    _, path = url.split("://")
    # the newest reached the bucket; an older one may not have (a copy still queued is replaced by a newer one)
    written = s3.written(f"{path}/manifests/")
    assert "step-00000012.json" in written
    assert written <= {"step-00000004.json", "step-00000008.json", "step-00000012.json"}
    shutil.rmtree(first)

    torch.manual_seed(123)
    m2 = Tiny(seed=5)
    c2 = LayerCheckpoint(dirpath=url + "/", **cb)
    t2 = trainer(20, [c2], str(second))
    t2.fit(m2, ckpt_path="last")
    assert c2.restored["step"] == 12 and c2.restored["manifest"] == f"{url}/manifests/step-00000012.json"
    assert_same(state_of(t, m), state_of(t2, m2))
    assert m.losses[12:] == m2.losses
    assert c2.dirpath == staging_dir_for(url, second)
    # the resumed run's saves reach the bucket too: its newest composite is the end of fit
    m3 = Tiny(seed=9)
    layerckpt.restore(url, m3, config=c2.layer_config)
    assert_same_tensors(m3.state_dict(), m.state_dict())


def test_url_dirpath_errors(tmp_path):
    with pytest.raises(layerckpt.ConfigError, match=r"dirpath='s3://a/run'\) is a URL, which makes it the remote "
                                                    r"tier, but the remote tier is also set to 's3://b/run'"):
        LayerCheckpoint(dirpath="s3://a/run", remote="s3://b/run")
    with pytest.raises(layerckpt.ConfigError, match="staging_dir='/tmp/x'\\) is the local directory of a URL dirpath"):
        LayerCheckpoint(dirpath=str(tmp_path), staging_dir="/tmp/x")
    with pytest.raises(layerckpt.ConfigError, match="fsspec knows no protocol 'nosuch'"):
        LayerCheckpoint(dirpath="nosuch://bucket/run")
    cb = LayerCheckpoint(dirpath="memory://bucket/run", staging_dir=str(tmp_path / "stage"))
    assert cb.dirpath == str(tmp_path / "stage") and cb.layer_config.remote == "memory://bucket/run"
    assert LayerCheckpoint(dirpath="s3://a/run", remote="s3://a/run/").layer_config.remote == "s3://a/run"


def test_resume_with_defaults_stays_close(tmp_path):
    """The fine-tuning story of the example: pre-trained weights, 240 fine-tuning steps, a checkpoint every 4
    with the default Config, stopped at step 170 and resumed from the composite of step 168."""
    mk = dict(n_layer=6, n_embd=128, dropout=0.0, scheduler_step=0, batch_size=16)
    t, m = reference(tmp_path, steps=240, finetune=True, **mk)
    t2, m2, cb = crashed_then_resumed(tmp_path, crash_at=170, steps=240, finetune=True, model=mk)
    assert cb.restored["step"] == 168 and cb.restored["max_staleness"] > 0
    assert len(set(cb.restored["layers"].values())) > 1  # a composite of layers saved at different steps
    assert t2.global_step == 240 and t2.fit_loop.state_dict() == t.fit_loop.state_dict()
    want, got = m.losses[168:], m2.losses
    assert len(got) == len(want) == 72
    first = cb.saves[0]  # the resumed run continues the composite it restored: its first save is selective too
    assert first.step == 172 and first.layers_persisted < first.layers_total
    assert abs(sum(got) - sum(want)) / sum(want) < 0.005


def test_resume_from_a_manifest_path(tmp_path):
    t, m = reference(tmp_path)
    t2, m2, _ = crashed_then_resumed(tmp_path, threshold=0.0,
                                     ckpt_path=lambda d: os.path.join(d, "manifests", "step-00000012.json"))
    assert_same(state_of(t, m), state_of(t2, m2))


def test_trainer_save_checkpoint_writes_a_standard_file(tmp_path):
    torch.manual_seed(7)
    m = Tiny()
    t = trainer(8, [LayerCheckpoint(dirpath=str(tmp_path / "run"), every_n_train_steps=4)], str(tmp_path))
    t.fit(m)
    gc.collect()
    assert [th.name for th in threading.enumerate() if th.name.startswith("layerckpt") and th.is_alive()] == []
    path = str(tmp_path / "manual.ckpt")
    t.save_checkpoint(path)  # after fit: returns once durable
    assert os.path.isfile(path) and torch.load(path, weights_only=True)["global_step"] == 8
    deadline = time.time() + 30  # once idle, the writer's thread goes
    while any(th.name.startswith("layerckpt") and th.is_alive() for th in threading.enumerate()):
        assert time.time() < deadline, "a layerckpt thread outlived trainer.save_checkpoint"
        time.sleep(0.01)
    assert sorted(os.listdir(tmp_path)) == ["manual.ckpt", "run"]  # no temporary file left
    ck = t.strategy.checkpoint_io.load_checkpoint(path)
    assert ck["global_step"] == 8 and ck["pytorch-lightning_version"]
    for k, v in m.state_dict().items():
        assert torch.equal(ck["state_dict"][k], v), k
    sd = t.optimizers[0].state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(ck["optimizer_states"][0]["state"][i][k], v)
    assert ck["lr_schedulers"] == [t.lr_scheduler_configs[0].scheduler.state_dict()]
    assert ck["hyper_parameters"]["n_embd"] == 32


def test_stats_reach_the_loggers(tmp_path):
    torch.manual_seed(7)
    m = Tiny()
    d = str(tmp_path / "run")
    logger = CSVLogger(str(tmp_path), name="logs")
    t = trainer(12, [LayerCheckpoint(dirpath=d, every_n_train_steps=4, keep_last=0)], str(tmp_path), logger=logger,
                log_every_n_steps=1)
    t.fit(m)
    rows = list(csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv"))))
    logged = {int(r["step"]): r for r in rows if r.get("layerckpt/bytes_written")}
    assert sorted(logged) == [4, 8, 12]
    for step, r in logged.items():
        size = os.path.getsize(os.path.join(d, "data", f"step-{step:08d}.rank0.safetensors"))
        assert int(float(r["layerckpt/bytes_written"])) == size
        mf = json.load(open(os.path.join(d, "manifests", f"step-{step:08d}.json")))
        persisted = sum(1 for e in mf["layers"].values() if e["step"] == step)
        assert int(float(r["layerckpt/layers_persisted"])) == persisted
        assert int(float(r["layerckpt/max_staleness"])) == max(e["age"] for e in mf["layers"].values())
        assert float(r["layerckpt/stall_ms"]) > 0 and float(r["layerckpt/flush_gbps"]) > 0
        assert float(r["layerckpt/stall_ms"]) == pytest.approx(
            float(r["layerckpt/save_return_ms"]) + float(r["layerckpt/step_wait_ms"]), rel=1e-6)


def test_stall_ms_counts_the_wait_in_the_next_step(tmp_path):
    """Under lazy staging the step after a save waits for its copies: the logged stall includes that wait
    (made long here: the copies are let go ``HELD`` seconds after that step begins waiting), save_return_ms
    does not."""
    from layerckpt import _faults
    torch.manual_seed(7)
    logger = CSVLogger(str(tmp_path), name="logs")
    cb = LayerCheckpoint(dirpath=str(tmp_path / "run"), every_n_train_steps=4, keep_last=0)
    t = trainer(10, [cb], str(tmp_path), logger=logger, log_every_n_steps=1)
    HELD, waiting, copies = 0.2, threading.Event(), []

    def copied():  # the saves at steps 4 and 8 (a step follows each) hold their copies until that step waits
        copies.append(1)
        if len(copies) <= 2:
            assert waiting.wait(30)
            waiting.clear()
            time.sleep(HELD)

    _faults.install("stage.copied", copied)
    _faults.install("stage.step-waits", waiting.set)
    try:
        t.fit(Tiny())
    finally:
        _faults.remove("stage.copied")
        _faults.remove("stage.step-waits")
    rows = list(csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv"))))
    logged = {int(r["step"]): r for r in rows if r.get("layerckpt/stall_ms")}
    assert sorted(logged) == [4, 8, 10]
    for step in (4, 8):  # a step follows each: it waited for the rest of the copies
        r = logged[step]
        wait, ret = float(r["layerckpt/step_wait_ms"]), float(r["layerckpt/save_return_ms"])
        assert wait >= HELD * 1e3, (step, wait)  # at least from the step's wait to the copies let go
        assert float(r["layerckpt/stall_ms"]) == pytest.approx(wait + ret, rel=1e-6)
        p = next(p for p in cb.saves if p.step == step)
        assert wait == pytest.approx(p.step_wait_s * 1e3, rel=1e-6)
        assert ret == pytest.approx(p.save_return_s * 1e3, rel=1e-6)  # save() returned before the copies ended
    assert float(logged[10]["layerckpt/step_wait_ms"]) == 0.0  # the last save: no step after it


def test_ordinary_ckpt_still_loads(tmp_path):
    """A run checkpointed by Lightning itself (enabled=False) resumes under an enabled LayerCheckpoint."""
    t, m = reference(tmp_path, dropout=0.0)  # Lightning's .ckpt has no RNG states: leave the RNG out of it
    torch.manual_seed(7)
    m1 = Tiny(dropout=0.0)
    cb = LayerCheckpoint(dirpath=str(tmp_path / "plain"), every_n_train_steps=4, enabled=False)
    t1 = trainer(20, [cb, CrashAt(14)], str(tmp_path))
    with pytest.raises(Crash):
        t1.fit(m1)
    last = str(tmp_path / "plain" / "last.ckpt")
    assert os.path.isfile(last) and torch.load(last, weights_only=True)["global_step"] == 12
    m2 = Tiny(seed=5, dropout=0.0)
    t2 = trainer(20, [LayerCheckpoint(dirpath=str(tmp_path / "new"), every_n_train_steps=4)], str(tmp_path))
    t2.fit(m2, ckpt_path=last)
    assert_same(state_of(t, m), state_of(t2, m2))
    assert glob.glob(str(tmp_path / "new" / "manifests" / "*.json"))  # and it now saves through layerckpt


def test_disabled_is_lightnings_own_checkpointing(tmp_path):
    torch.manual_seed(7)
    m = Tiny()
    d = tmp_path / "plain"
    t = trainer(8, [LayerCheckpoint(dirpath=str(d), every_n_train_steps=4, enabled=False)], str(tmp_path))
    t.fit(m)
    assert sorted(os.listdir(d)) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    assert not isinstance(t.strategy.checkpoint_io, LayerCheckpointIO)


@pytest.mark.parametrize("what", ["empty", "foreign"])
def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path, what):
    d = tmp_path / "dir"
    d.mkdir()
    if what == "foreign":
        (d / "weights.bin").write_bytes(b"\0" * 64)
    t = trainer(4, [LayerCheckpoint(dirpath=str(tmp_path / "run"))], str(tmp_path))
    with pytest.raises(layerckpt.CheckpointNotFoundError, match="is a directory but not a layerckpt checkpoint"):
        t.fit(Tiny(), ckpt_path=str(d))


@pytest.mark.parametrize("kw, field", [
    ({"every_n_train_steps": -1}, "every_n_train_steps"), ({"every_n_epochs": -2}, "every_n_epochs"),
    ({"threshold": -0.1}, "threshold"), ({"max_staleness": 0}, "max_staleness"), ({"keep_last": -1}, "keep_last"),
    ({"staging_bytes": "lots"}, "staging_bytes"),
])
def test_invalid_values_fail_at_construction_naming_the_field(kw, field):
    with pytest.raises((layerckpt.ConfigError, MisconfigurationException), match=field):
        LayerCheckpoint(**kw)


def test_config_yaml_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("layerckpt:\n  threshold: 0.2\n  max_staleness: 7\n")
    cb = LayerCheckpoint(config=str(y), max_staleness=9)
    assert cb.layer_config.threshold == 0.2 and cb.layer_config.max_staleness == 9
    with pytest.raises(layerckpt.ConfigError, match="enabled"):
        LayerCheckpoint(enabled="no")


def test_config_fields_are_typed_parameters_checked_by_type():
    """One keyword parameter per Config field, generated from dataclasses.fields(Config): a field added to
    Config is a parameter at once; a wrong type or an unknown name is refused, naming both."""
    import dataclasses
    import inspect
    from typing import Optional, Union

    params = inspect.signature(LayerCheckpoint).parameters
    assert {f.name for f in dataclasses.fields(layerckpt.Config)} <= set(params)
    assert params["keep_last"].annotation == Optional[int] and params["keep_last"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["staging_bytes"].annotation == Union[int, str, None] and params["lazy_staging"].default is None
    assert not [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    with pytest.raises(layerckpt.ConfigError, match=r"LayerCheckpoint\(keep_last='three'\): Config.keep_last takes "
                                                    r"int, got str"):
        LayerCheckpoint(keep_last="three")
    with pytest.raises(layerckpt.ConfigError, match=r"LayerCheckpoint\(memory_tier=1\): Config.memory_tier takes "
                                                    r"bool, got int"):
        LayerCheckpoint(memory_tier=1)
    with pytest.raises(layerckpt.ConfigError, match=r"LayerCheckpoint\(\) got unknown argument\(s\) keep_lastt; "):
        LayerCheckpoint(keep_lastt=3)
    cb = LayerCheckpoint(staging_bytes="64MiB", lazy_staging=False, keep_last=2.0, fidelity=0)
    assert cb.layer_config.staging_bytes == 64 << 20 and cb.layer_config.lazy_staging is False
    assert cb.layer_config.keep_last == 2 and cb.layer_config.fidelity == 0.0
    assert LayerCheckpoint(monitor="loss").layer_config.keep_last == 1  # the monitor's default, as before


def test_lightning_cli_checks_config_fields_by_type(tmp_path, capsys):
    """LightningCLI (jsonargparse) reads the generated signature: each field's type is checked from YAML."""
    from lightning.pytorch.cli import LightningCLI

    def cli(extra: str):
        y = cli_yaml(tmp_path / "cfg.yaml", tmp_path, 2, f"dirpath: {tmp_path / 'ck'}\nevery_n_train_steps: 2\n{extra}")
        return LightningCLI(FineTuneModule, args=["--config", str(y)], save_config_callback=None, run=False)

    cb = cli("staging_bytes: 64MiB\nlazy_staging: false\nkeep_last: 3").trainer.checkpoint_callback
    assert cb.layer_config.staging_bytes == 64 << 20 and cb.layer_config.lazy_staging is False
    assert cb.layer_config.keep_last == 3
    for bad in ("keep_last: three", "memory_tier: sometimes", "remote_options: 5"):
        with pytest.raises(SystemExit):  # jsonargparse refuses it by the field's type, before LayerCheckpoint runs
            cli(bad)
        assert bad.split(":")[0] in capsys.readouterr().err


def cli_yaml(path, root, max_steps: int, init_args: str):
    """A LightningCLI config: a tiny FineTuneModule, a LayerCheckpoint with ``init_args`` (YAML lines)."""
    args = "".join(f"        {line}\n" for line in init_args.splitlines())
    path.write_text(f"""
trainer:
  max_steps: {max_steps}
  accelerator: cpu
  logger: false
  enable_progress_bar: false
  default_root_dir: {root}
  callbacks:
    - class_path: lightning_layerckpt.LayerCheckpoint
      init_args:
{args}model:
  n_layer: 2
  n_embd: 32
""")
    return path


def test_flush_error_stops_training(tmp_path):
    """A flush that fails raises in the training process (at the next batch or the end of fit)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs-lit", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        torch.manual_seed(7)
        t = trainer(12, [LayerCheckpoint(dirpath=str(mnt / "ck"), every_n_train_steps=4)], str(tmp_path))
        with pytest.raises(layerckpt.CheckpointWriteError, match="No space left"):
            t.fit(Tiny())
        assert t.global_step < 12  # raised during training, not after it
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_fsdp1_is_refused_naming_the_sharded_strategy_that_works():
    """FSDP needs a GPU in Lightning, so its strategy object is checked directly: setup() runs this check.
    ModelParallelStrategy (FSDP2) is supported: tests/test_sharded.py resumes under it on 2 processes."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from lightning_layerckpt.callback import _refuse_sharded

    with pytest.raises(layerckpt.CheckpointError, match="does not support FSDPStrategy.*use ModelParallelStrategy"):
        _refuse_sharded(FSDPStrategy())
    _refuse_sharded(ModelParallelStrategy())  # FSDP2: each rank's shards
    _refuse_sharded(L.strategies.DDPStrategy())  # DDP is fine


def test_checkpoint_io_on_its_own(tmp_path):
    """Trainer(plugins=[LayerCheckpointIO()]) with Lightning's ModelCheckpoint: standard files, rotated."""
    d = str(tmp_path / "mc")

    def make(steps, extra=()):
        return trainer(steps, [ModelCheckpoint(dirpath=d, every_n_train_steps=4, save_last=True), *extra],
                       str(tmp_path), plugins=[LayerCheckpointIO()])

    torch.manual_seed(7)
    m = Tiny(dropout=0.0)
    t = make(12, [CrashAt(10)])
    with pytest.raises(Crash):
        t.fit(m)
    assert sorted(os.listdir(d)) == ["epoch=0-step=8.ckpt", "last.ckpt"]  # top-1 rotation removed step 4
    assert all(torch.load(os.path.join(d, n), weights_only=True)["global_step"] == 8 for n in os.listdir(d))
    torch.manual_seed(7)
    ref = Tiny(dropout=0.0)
    trainer(12, [], str(tmp_path), enable_checkpointing=False).fit(ref)
    m2 = Tiny(seed=5, dropout=0.0)
    t2 = make(12)
    t2.fit(m2, ckpt_path="last")
    for (k, a), b in zip(ref.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k


def test_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    for enabled in (True, False):
        d = tmp_path / f"ck{enabled}"
        y = cli_yaml(tmp_path / f"cfg{enabled}.yaml", tmp_path, 8,
                     f"dirpath: {d}\nevery_n_train_steps: 4\nthreshold: 0.1\nenabled: {str(enabled).lower()}")
        cli = LightningCLI(FineTuneModule, args=["fit", "--config", str(y)], save_config_callback=None)
        cb = cli.trainer.checkpoint_callback
        assert isinstance(cb, LayerCheckpoint) and cb.enabled is enabled
        if enabled:
            assert cb.layer_config.threshold == 0.1
            assert [s for s, _ in store.list_manifests(str(d))] == [4, 8]
        else:
            assert sorted(os.listdir(d)) == ["epoch=0-step=8.ckpt", "last.ckpt"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_ranks_share_the_writes_and_resume(tmp_path):
    """Trainer(strategy="ddp", devices=2) on gloo: disjoint shares, one commit, every rank resumes bit-exact."""
    script = os.path.join(HERE, "lit_helpers.py")
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for mode in ("ref", "crash", "resume"):
        env["MASTER_PORT"] = str(_free_port())
        r = subprocess.run([sys.executable, script, str(tmp_path), mode, "0.0"], capture_output=True, text=True,
                           timeout=240, env=env)
        assert r.returncode == 0, f"{mode}: {r.stderr[-3000:]}"
    for rank in (0, 1):
        a = json.load(open(tmp_path / f"ref.rank{rank}.json"))
        b = json.load(open(tmp_path / f"resume.rank{rank}.json"))
        assert a == b, rank  # weights, optimizer state, loops and the RNG after the run
    m = json.load(open(layerckpt.read_checkpoint(str(tmp_path / "run")).manifest))
    assert m["world_size"] == 2
    by_rank = {}
    for name, e in m["layers"].items():
        by_rank.setdefault(e["rank"], set()).add(name)
    assert set(by_rank) == {0, 1} and not (by_rank[0] & by_rank[1])
    files = {e["file"] for e in m["tensors"].values()}
    assert {f for f in files if ".rank0." in f} and {f for f in files if ".rank1." in f}


@pytest.mark.parametrize("trigger, kw, steps", [
    ("every_n_epochs", {"every_n_epochs": 1}, [4, 8]),
    ("train_time_interval", {"train_time_interval": __import__("datetime").timedelta(0)}, [1, 2, 3, 4, 5, 6, 7, 8]),
])
def test_triggers_are_modelcheckpoints(tmp_path, trigger, kw, steps):
    torch.manual_seed(7)
    d = str(tmp_path / "run")
    t = trainer(-1, [LayerCheckpoint(dirpath=d, keep_last=0, **kw)], str(tmp_path), max_epochs=2,
                limit_train_batches=4)
    t.fit(Tiny())
    from layerckpt.format._store import list_manifests

    assert [s for s, _ in list_manifests(d)] == steps


def test_export_of_a_checkpoint_holding_pretrained_references_takes_the_files(tmp_path, capsys):
    """A LayerCheckpoint run with Config.pretrained holds its frozen embeddings by reference: export --lightning
    is refused without --pretrained (naming it, writing nothing) and with it writes every tensor, bit for bit."""
    from safetensors.torch import save_file

    from layerckpt import cli

    torch.manual_seed(7)
    m = Tiny()
    frozen = [n for n, p in m.named_parameters() if ".wte." in n or ".wpe." in n]
    assert frozen
    for n, p in m.named_parameters():
        p.requires_grad_(n not in frozen)
    pre = str(tmp_path / "pretrained.safetensors")
    save_file({k: v.detach().clone() for k, v in m.state_dict().items()}, pre)
    cb = LayerCheckpoint(dirpath=str(tmp_path / "run"), every_n_train_steps=4, pretrained=pre)
    trainer(8, [cb], str(tmp_path)).fit(m)
    held = json.load(open(cb.best_model_path))["pretrained"]
    assert {k.split("/", 1)[1] for k in held} >= set(frozen)  # not written
    # layers from the steps they were saved at
    composite = layerckpt.read_checkpoint(cb.best_model_path, config=layerckpt.Config(pretrained=pre)).model
    out = tmp_path / "model.ckpt"
    assert cli.main(["export", cb.best_model_path, "--lightning", "-o", str(out)]) == 2
    assert "--pretrained PATH" in capsys.readouterr().err
    assert not out.exists()
    assert cli.main(["export", cb.best_model_path, "--lightning", "-o", str(out), "--pretrained", pre]) == 0
    raw = torch.load(out, weights_only=True)["state_dict"]
    assert raw.keys() == m.state_dict().keys() == composite.keys()
    for k, v in composite.items():
        assert torch.equal(raw[k], v), k
    for k in frozen:
        assert torch.equal(raw[k], m.state_dict()[k]), k
    # load_from_checkpoint: refused naming its own keyword, then the module whole (a model's hyper-parameters pass)
    from layerckpt.errors import PretrainedNeededError
    from lightning_layerckpt import load_from_checkpoint

    with pytest.raises(PretrainedNeededError, match=r"load_from_checkpoint\(cls, path, pretrained_files=PATH\)"):
        load_from_checkpoint(type(m), cb.best_model_path)
    loaded = load_from_checkpoint(type(m), cb.best_model_path, pretrained_files=pre)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, composite[k]), k


def test_export_writes_a_standard_ckpt_that_load_from_checkpoint_takes(tmp_path):
    torch.manual_seed(7)
    m = Tiny()
    cb = LayerCheckpoint(dirpath=str(tmp_path / "run"), every_n_train_steps=4)
    t = trainer(8, [cb], str(tmp_path))
    t.fit(m)
    out = tmp_path / "model.ckpt"
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "export", cb.best_model_path, "--lightning", "-o",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    raw = torch.load(out, weights_only=True)  # nothing pickled but tensors and plain values
    assert raw["global_step"] == 8 and "layerckpt" not in raw
    loaded = type(m).load_from_checkpoint(out)
    composite = layerckpt.read_checkpoint(cb.best_model_path).model  # layers from the steps they were saved at
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, composite[k]), k
    t2 = trainer(12, [], str(tmp_path / "again"))
    t2.fit(Tiny(), ckpt_path=str(out))  # and Lightning's own loader resumes from it
    assert t2.global_step == 12
