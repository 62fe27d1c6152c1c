"""layerckpt.Interval: the checkpoint interval sqrt(2 x C x MTBF) in steps, measured online (stubbed clock)."""
import math
from datetime import timedelta

import pytest

import layerckpt
from layerckpt.errors import ConfigError
from layerckpt.interval import parse_duration


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Save(layerckpt.PendingSave):
    """A save whose cost training pays as ``ret`` seconds in save() and ``wait`` in the next step."""

    def __init__(self, step, ret, wait=0.0):
        super().__init__(step, f"/x/manifests/step-{step}.json")
        self.stall_s, self.step_wait_s = ret, wait


def train(interval, clock, steps, step_s, cost, start=0):
    """``steps`` training steps of ``step_s`` seconds; a save (when due) costs ``cost(step)`` seconds,
    half in save() and half in the next step, and is durable after that step.  Returns the steps saved at."""
    saved = []
    pending = None
    for step in range(start, start + steps):
        clock.t += step_s
        if pending is not None:  # this step waited for the previous save's copies; then it is durable
            clock.t += pending.step_wait_s
            pending._done.set()
            pending = None
        if interval.due(step):
            c = cost(step)
            pending = Save(step, c / 2, c / 2)
            clock.t += c / 2
            interval.saved(pending)
            saved.append(step)
    return saved


def test_the_interval_is_young_s_optimum_in_steps_and_tracks_a_changing_cost():
    clock = Clock()
    iv = layerckpt.Interval(mtbf="8h", min_steps=5, max_steps=100000, smoothing=1.0, clock=clock)
    assert iv.steps == 5  # nothing measured yet: the lower bound
    assert iv.metrics() == {"layerckpt/interval_steps": 5.0, "layerckpt/interval_mtbf_s": 28800.0}
    saved = train(iv, clock, 1000, 0.5, lambda s: 2.0)
    # before a save's cost is known, a save costs one step: not at the first step, but at sqrt(2 x 0.5 x 8h) / 0.5
    assert saved[0] == round(math.sqrt(2 * 0.5 * 8 * 3600) / 0.5) - 1  # (counted from the step before the first)
    assert iv.step_s == pytest.approx(0.5) and iv.checkpoint_cost_s == pytest.approx(2.0)
    assert iv.steps == round(math.sqrt(2 * 2.0 * 8 * 3600) / 0.5)  # 679 steps: ~5.7 minutes
    first = iv.steps
    saved = train(iv, clock, 4000, 0.5, lambda s: 8.0, start=1000)  # the saves get 4x as costly
    assert iv.checkpoint_cost_s == pytest.approx(8.0)
    assert iv.steps == round(math.sqrt(2 * 8.0 * 8 * 3600) / 0.5) == pytest.approx(2 * first, abs=1)
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    assert gaps[-1] == iv.steps  # saves are taken at the new interval
    m = iv.metrics()
    assert m["layerckpt/interval_steps"] == iv.steps and m["layerckpt/interval_mtbf_s"] == 8 * 3600
    assert m["layerckpt/interval_ckpt_cost_s"] == pytest.approx(8.0)
    assert m["layerckpt/interval_step_s"] == pytest.approx(0.5)


def test_a_cheaper_selective_save_is_taken_more_often_and_the_bounds_hold():
    def steps_for(cost, **kw):
        clock = Clock()
        iv = layerckpt.Interval(mtbf=3600, smoothing=1.0, clock=clock, **kw)
        train(iv, clock, 3000, 0.1, lambda s: cost)
        return iv.steps

    full, selective = steps_for(1.0), steps_for(0.25)
    assert selective == pytest.approx(full / 2, abs=1) and full == round(math.sqrt(2 * 3600) / 0.1)
    assert steps_for(1.0, max_steps=300) == 300
    assert steps_for(0.25, min_steps=1000, max_steps=2000) == 1000


def test_moving_average_and_due_once_per_step():
    clock = Clock()
    iv = layerckpt.Interval(mtbf="1h", min_steps=3, max_steps=3, clock=clock)
    assert iv.due(0) is False and iv.due(1) is False
    clock.t = 1.0
    assert iv.due(2) is True
    assert iv.due(2) is False  # asked again at the same step
    iv.saved([Save(2, 0.5), Save(2, 0.5)])  # two models of one save: one checkpoint costing 1s
    clock.t = 3.0
    iv.due(3)
    assert iv.checkpoint_cost_s is None  # still in flight: its cost is still adding up
    iv.saved(Save(3, 3.0))  # the next save completes the one before
    clock.t = 10.0
    iv.due(4)
    step = 0.3 * 1.0  # steps 0-2 took 0 s then 1 s: the moving average of the step time
    assert iv.step_s == pytest.approx(step)
    # blocked 1 s, and its step took 3 - 1 - 1 = 1 s (less what it blocked) where a step takes 0.3 s
    assert iv.checkpoint_cost_s == pytest.approx(1.0 + (1.0 - step))


def train_slowed(interval, clock, steps, step_s, blocked, slowed, for_steps, copies=False):
    """Steps of ``step_s``; a save blocks ``blocked`` s and makes each of the ``for_steps`` steps after it
    ``slowed`` s longer (its flush shares the machine), then it is durable; with ``copies``, it is durable at once
    and it is the tiers' copies after its commit that slow those steps.  Returns the steps saved at."""
    saved, flying, left = [], None, [0]
    for step in range(steps):
        clock.t += step_s
        if left[0]:
            clock.t += slowed
            left[0] -= 1
            if not left[0]:
                flying._done.set()
        if interval.due(step):
            flying = Save(step, blocked)
            if copies:
                flying._done.set()
                flying._copying = lambda: left[0] > 0
            clock.t += blocked
            interval.saved(flying)
            saved.append(step)
            left[0] = for_steps
    return saved


@pytest.mark.parametrize("copies", [False, True], ids=["its flush", "the tiers' copies after its commit"])
def test_a_save_that_slows_the_steps_after_it_costs_them_too(copies):
    clock = Clock()
    iv = layerckpt.Interval(mtbf=3600, smoothing=1.0, clock=clock)
    saved = train_slowed(iv, clock, 2000, 0.5, blocked=0.1, slowed=0.4, for_steps=3, copies=copies)
    assert iv.step_s == pytest.approx(0.5)  # measured on the steps no save shared
    assert iv.checkpoint_cost_s == pytest.approx(0.1 + 3 * 0.4)  # blocked + the three slowed steps
    assert iv.steps == round(math.sqrt(2 * 1.3 * 3600) / 0.5)  # 193 steps, where the blocking alone says 54
    assert saved[1] - saved[0] > 3  # the first save finished before a second one was taken
    assert [b - a for a, b in zip(saved, saved[1:])][-1] == iv.steps


@pytest.mark.parametrize("text,seconds", [("8h", 28800), ("30m", 1800), ("2d", 172800), ("45", 45), (90, 90),
                                          (timedelta(hours=1), 3600), ("1.5h", 5400)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("kw,msg", [({"mtbf": "8 hours"}, "not a duration"), ({"mtbf": 0}, "positive"),
                                    ({"mtbf": "1h", "min_steps": 0}, "min_steps"),
                                    ({"mtbf": "1h", "min_steps": 10, "max_steps": 5}, "max_steps"),
                                    ({"mtbf": "1h", "smoothing": 0}, "smoothing")])
def test_bad_arguments_name_the_argument(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        layerckpt.Interval(**kw)


# ------------------------------------------------------------------ Lightning: LayerCheckpoint(mtbf=...)

def test_lightning_saves_at_the_interval_and_logs_it(tmp_path):
    import lightning  # noqa: F401
    import csv
    import os

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning_layerckpt import LayerCheckpoint
    from lit_helpers import Tiny, trainer

    clock = Clock()

    def tick():  # every due() is one more second of training
        clock.t += 1.0
        return clock.t

    class Durable(L.Callback):
        """Each save is durable before the next step trains: which step's due() finds a save still in flight
        (and so when its cost is complete) no longer hangs on how fast the flusher ran on a loaded machine."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cb.last_save is not None:
                cb.last_save.wait()

    iv = layerckpt.Interval(mtbf="1h", min_steps=3, max_steps=3, smoothing=1.0, clock=tick)
    cb = LayerCheckpoint(dirpath=str(tmp_path / "run"), mtbf=iv, keep_last=0)
    logger = CSVLogger(str(tmp_path), name="logs")
    trainer(10, [cb, Durable()], str(tmp_path), logger=logger, log_every_n_steps=1).fit(Tiny())
    assert [p.step for p in cb.saves] == [3, 6, 9, 10]  # the interval's, then the end of fit
    # a save's cost is complete at the first step no save shares after it (step 8 for the save of step 6, durable
    # before step 7 trains): at step 9 and at the end of fit, the cost is the one of step 6
    assert iv.checkpoint_cost_s == pytest.approx(cb.saves[1].blocked_s, abs=1e-6)
    rows = list(csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv"))))
    logged = {int(r["step"]): r for r in rows if r.get("layerckpt/interval_steps")}
    assert sorted(logged) == [3, 6, 9] and all(float(r["layerckpt/interval_steps"]) == 3 for r in logged.values())
    assert float(logged[9]["layerckpt/interval_mtbf_s"]) == 3600
    assert float(logged[9]["layerckpt/interval_ckpt_cost_s"]) == pytest.approx(cb.saves[1].blocked_s, rel=1e-6)


def test_lightning_mtbf_string_and_refused_beside_another_trigger():
    import lightning  # noqa: F401
    from lightning_layerckpt import LayerCheckpoint

    cb = LayerCheckpoint(mtbf="8h")
    assert cb.interval.mtbf_s == 8 * 3600 and cb.every_n_epochs == 0 and cb._every_n_train_steps == 0
    assert LayerCheckpoint().interval is None and LayerCheckpoint().every_n_epochs == 1  # unchanged default
    with pytest.raises(ConfigError, match=r"mtbf='8h'.*every_n_train_steps=50"):
        LayerCheckpoint(mtbf="8h", every_n_train_steps=50)
    with pytest.raises(ConfigError, match="not a duration"):
        LayerCheckpoint(mtbf="often")
    with pytest.raises(ConfigError, match=r"enabled=False.*every_n_train_steps"):
        LayerCheckpoint(mtbf="8h", enabled=False)
