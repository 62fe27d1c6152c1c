"""Each save's metrics reach the frameworks' trackers: Accelerate's (``accelerator.log``) and Fabric's loggers
(``fabric.log_dict``), once the save committed, under the Lightning callback's names.  The bytes and layers
logged are checked against the store on disk (the sizes the file system gives the data files each save wrote,
the layers its committed manifest records at its step), not against the library's own counts."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

import accelerate  # noqa: F401
import lightning  # noqa: F401
from accelerate import Accelerator  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.loggers import Logger  # noqa: E402

import layerckpt  # noqa: E402
from accelerate_fixtures import fresh_accelerate  # noqa: E402,F401
from accelerate_helpers import tiny  # noqa: E402
from accelerate_layerckpt import LayerCheckpointPlugin  # noqa: E402
from conftest import small_model  # noqa: E402
from layerckpt.bench.workload import batch, make_optimizer  # noqa: E402
from layerckpt.metrics import SaveMetrics, save_metrics  # noqa: E402
from lightning_layerckpt import LayerFabricCheckpoint  # noqa: E402

NAMES = {"layerckpt/" + n for n in ("bytes_written", "layers_persisted", "stall_ms", "save_return_ms",
                                    "step_wait_ms", "flush_gbps", "max_staleness")}


def _written(root, p):
    """(bytes, layers, all layers) of the committed save ``p`` in the store under ``root``, measured there: the
    os.stat sizes of the data files its manifest (the store's one manifest of its step) names as written at that
    step, the layers it records as persisted at that step, and the layers it records at all."""
    name = f"step-{p.step:08d}.json"
    (manifest,) = [os.path.join(d, name) for d, _, files in os.walk(root)
                   if os.path.basename(d) == "manifests" and name in files]
    with open(manifest) as f:
        m = json.load(f)
    data = os.path.join(os.path.dirname(os.path.dirname(manifest)), "data")
    files = [f for f, e in m["files"].items() if e["step"] == p.step]
    assert files, f"{manifest} names no data file written at step {p.step}"
    layers = sum(1 for e in m["layers"].values() if e["step"] == p.step)
    return sum(os.stat(os.path.join(data, f)).st_size for f in files), layers, len(m["layers"])


class Recording(GeneralTracker):
    """An accelerate tracker that keeps what it is given."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.logged = []

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))


class FabricRecording(Logger):
    def __init__(self):
        self.logged = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _accelerate_run(tmp_path, tracker, every=3, steps=9, **plugin_kw):
    acc = Accelerator(cpu=True, log_with=[tracker], project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    acc.init_trackers("run")
    model = tiny(0)
    model, opt = acc.prepare(model, make_optimizer(model))
    plugin_kw.setdefault("wait_below", 0)  # every save in the background, as a large model's
    plugin = LayerCheckpointPlugin(layerckpt.Config(threshold=0.0), **plugin_kw).register(acc)
    saves = []
    for s in range(1, steps + 1):
        x, y = batch("affine", s)
        acc.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        opt.step()
        opt.zero_grad()
        if s % every == 0:
            acc.save_state()
            saves.append((s, plugin.last_saves))
    return acc, plugin, saves


def test_accelerate_logs_each_save_to_its_trackers_once_committed(tmp_path):
    tracker = Recording()
    acc, plugin, saves = _accelerate_run(tmp_path, tracker)
    plugin.wait()
    mine = [(step, m) for step, m in tracker.logged if any(k.startswith("layerckpt/") for k in m)]
    assert [step for step, _ in mine] == [3, 6, 9]  # at the optimizer step each save_state was made
    for (step, m), (_, pend) in zip(mine, saves):
        (p,) = pend
        on_disk, layers, every = _written(tmp_path, p)
        assert set(m) == NAMES
        assert m["layerckpt/bytes_written"] == float(on_disk) > 0
        assert m["layerckpt/layers_persisted"] == layers == every > 0  # threshold 0: every layer, each save
        assert m["layerckpt/stall_ms"] == pytest.approx((p.stall_s + p.step_wait_s) * 1e3)
        assert m["layerckpt/flush_gbps"] == pytest.approx(on_disk / p.durable_s / 1e9)
    plugin.wait()
    assert len([1 for _, m in tracker.logged if "layerckpt/stall_ms" in m]) == 3  # each save logged once
    acc.end_training()


def test_accelerate_log_stats_off_logs_nothing(tmp_path):
    tracker = Recording()
    acc, plugin, _ = _accelerate_run(tmp_path, tracker, every=2, steps=4, log_stats=False)
    plugin.close()
    assert tracker.logged == []
    acc.end_training()


class _Done(layerckpt.PendingSave):
    def __init__(self, step, done=True, error=None, nbytes=1000):
        super().__init__(step, f"/x/manifests/step-{step}.json")
        self.bytes_written, self.durable_s, self.layers_persisted = nbytes, 1e-6, 2
        self.stall_s, self.max_staleness, self.error = 0.5, step, error
        if done:
            self._done.set()


def test_metrics_are_handed_back_once_per_committed_save_and_never_wait():
    q = SaveMetrics()
    flushing, failed = _Done(2, done=False), _Done(3, error=OSError("disk"))
    q.add(_Done(1))
    q.add([flushing, _Done(2)], step=20)  # two models of one save_state: one entry, once both committed
    q.add(failed)
    assert [s for s, _ in q.finished()] == [1]  # the failed one is dropped, the group still flushes
    assert len(q) == 1 and q.finished() == []
    flushing._done.set()
    ((step, m),) = q.finished()
    assert step == 20 and m["layerckpt/bytes_written"] == 2000.0 and m["layerckpt/layers_persisted"] == 4.0
    assert m["layerckpt/flush_gbps"] == pytest.approx(2000 / 1e-6 / 1e9) and m["layerckpt/stall_ms"] == 1000.0
    assert save_metrics(_Done(5))["layerckpt/max_staleness"] == 5.0


def test_fabric_logs_each_save_through_log_dict(tmp_path):
    logger = FabricRecording()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    model = small_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    ckpt = LayerFabricCheckpoint(fabric, threshold=0.0)
    made = []
    for step in (4, 8):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        fabric.backward(F.cross_entropy(model(x).flatten(0, 1), x.flatten()))
        opt.step()
        opt.zero_grad()
        fabric.save(str(tmp_path / "ckpts"), {"model": model, "optimizer": opt, "step": step})
        made.append(ckpt.last_save)
    ckpt.close()
    assert [s for s, _ in logger.logged] == [4, 8]
    for (_, m), p in zip(logger.logged, made):
        on_disk, layers, _ = _written(tmp_path, p)
        assert set(m) == NAMES
        assert m["layerckpt/bytes_written"] == float(on_disk) > 0
        assert m["layerckpt/layers_persisted"] == layers > 0
        assert m["layerckpt/flush_gbps"] == pytest.approx(on_disk / p.durable_s / 1e9)
        assert m["layerckpt/save_return_ms"] == pytest.approx(p.stall_s * 1e3)


def test_accelerate_logs_a_save_only_once_committed_and_never_waits_for_it(tmp_path):
    import threading

    from layerckpt import _faults

    tracker = Recording()
    held = threading.Event()
    _faults.install("commit.before", lambda: held.wait(30))  # the flush holds before its commit
    try:
        acc, plugin, saves = _accelerate_run(tmp_path, tracker, every=2, steps=3)  # saves at 2; step 3 after it
        assert not saves[0][1][0].done()  # still held: the backward of step 3 returned without it
        assert [m for _, m in tracker.logged if "layerckpt/stall_ms" in m] == []
    finally:
        held.set()
        _faults.remove("commit.before")
    plugin.wait()
    assert [s for s, m in tracker.logged if "layerckpt/stall_ms" in m] == [2]
    acc.end_training()


def test_fabric_log_stats_off(tmp_path):
    logger = FabricRecording()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    model = fabric.setup(small_model(0))
    with LayerFabricCheckpoint(fabric, log_stats=False):
        fabric.save(str(tmp_path / "ckpts"), {"model": model, "step": 1})
    assert logger.logged == []


def test_accelerate_metrics_reach_a_tensorboard_event_file(tmp_path):
    import tensorboard  # noqa: F401
    from accelerate.utils import LoggerType
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = Accelerator(cpu=True, log_with=LoggerType.TENSORBOARD, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), logging_dir=str(tmp_path / "tb"), automatic_checkpoint_naming=True))
    acc.init_trackers("run")
    model = tiny(0)
    model, opt = acc.prepare(model, make_optimizer(model))
    plugin = LayerCheckpointPlugin(layerckpt.Config(threshold=0.0)).register(acc)
    made = []
    for s in range(1, 5):
        x, y = batch("affine", s)
        acc.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        opt.step()
        opt.zero_grad()
        if s % 2 == 0:
            acc.save_state()
            made.append(plugin.last_saves[0])
    acc.end_training()  # closes the plugin first (every save logged), then the trackers
    (run_dir,) = [p for p in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    ev = EventAccumulator(str(run_dir.parent))
    ev.Reload()
    assert {"layerckpt/bytes_written", "layerckpt/stall_ms", "layerckpt/flush_gbps"} <= set(ev.Tags()["scalars"])
    written = ev.Scalars("layerckpt/bytes_written")
    assert [e.step for e in written] == [2, 4]
    assert [e.value for e in written] == [pytest.approx(_written(tmp_path, p)[0], rel=1e-6) for p in made]
