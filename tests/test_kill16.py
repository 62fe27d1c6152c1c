"""Sixteen ranks under kills: 16 gloo ranks save a sharded model (each rank its own rows, its own RNG), and one
rank dies by SIGKILL at a point of a save or of a restore (tests/kill16_helpers.py forks the ranks from one
launcher that imported torch once).

After every kill: no process outlives the run's timeout; the dead rank died of the SIGKILL and every survivor
failed with layerckpt's error naming it (or, where the rendezvous store died with it, saying that); no committed
checkpoint is lost (each one is there unless ``keep_last`` dropped it, and reads back bit for bit); the newest
one is the one the kill point allows; and the next run's sixteen ranks restore it, each its own shards,
optimizer state and RNG, bit for bit.  A rank killed during a restore leaves the others' restores whole."""
import collections
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import kill16_helpers as k16
import layerckpt

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill16_helpers.py")
pytestmark = pytest.mark.skipif(not (hasattr(os, "fork") and os.path.isdir("/proc/self/task")
                                     and torch.distributed.is_available()), reason="forks gloo ranks (Linux)")

AGREEMENT = "the ranks' agreement that every file of this save"  # the exchange once every rank's data is durable
OUTCOME = "learning from rank 0 whether step {s} is committed"  # rank 0's word after its commit
FORMING = "forming the checkpoint's process group"
STORE_GONE = "the rendezvous store does not answer either"
INSIDE = "every rank had reached it, so a rank died inside it"  # a kill inside a collective: no rank to name

# (point, rank, whether the save killed is committed all the same, how the survivors learn of the death):
# the default suite's kills of a save, in order, on one store (keep_last=2)
SAVE_KILLS = [
    ("flush.checksum", 7, False, AGREEMENT),  # its data file partly written, not durable
    ("flush.written", 12, False, AGREEMENT),  # its data durable, the ranks not agreed yet
    (k16.AGREED, 9, True, OUTCOME),  # every rank's data agreed on: rank 0 commits, and no one learns it
    ("commit.before", 0, False, OUTCOME),  # rank 0, its manifest not written (and the store's host: rank 0)
    ("commit.latest", 0, True, OUTCOME),  # rank 0, its manifest durable, ``latest`` not yet updated
    ("retain.manifests-dropped", 0, True, AGREEMENT),  # rank 0 in retention: every rank saw the commit
    (k16.SEEN, 5, True, AGREEMENT),  # some ranks saw the commit, rank 5 died before its wait() returned
]


def named(message: str) -> set:
    """The ranks a survivor's error says had not reached the collective that failed."""
    m = re.search(r"failed: ranks? ([\d, ]+) had not reached it", message)
    return {int(r) for r in m.group(1).split(", ")} if m else set()


class Launcher:
    """The launcher process (its own session: whatever it forked goes with it at the end)."""

    def __init__(self, tmp):
        self.err = open(os.path.join(tmp, "launcher.err"), "w+")
        self.proc = subprocess.Popen([sys.executable, HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert self._answer(300) == {"ready": True}

    def _stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-3000:]

    def _answer(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"the launcher did not answer within {timeout:.0f}s: {self._stderr()}"
        line = self.proc.stdout.readline()
        assert line, f"the launcher died: {self._stderr()}"
        return json.loads(line)

    def run(self, run: k16.Run) -> k16.Outcome:
        self.proc.stdin.write(json.dumps(asdict(run)) + "\n")
        self.proc.stdin.flush()
        d = self._answer(run.timeout_s + 120)
        return k16.Outcome(exit={int(r): c for r, c in d["exit"].items()},
                           logs={int(r): t for r, t in d["logs"].items()}, killed_at_s=d["killed_at_s"],
                           wall_s=d["wall_s"])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.err.close()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    lau = Launcher(str(tmp_path_factory.mktemp("launcher")))
    yield lau
    lau.close()


class Story:
    """One store through a series of runs, each ended by a kill: what it must hold after each."""

    def __init__(self, launcher: Launcher, tmp):
        self.launcher = launcher
        self.root, self.refs, self.logs = (str(tmp / n) for n in ("store", "refs", "logs"))
        self.known: set = set()  # every step known committed: reported by a rank, or seen on disk
        self.newest = 0
        self.kills = 0
        self.walls = []
        self.told = collections.Counter()  # what the survivors' errors said of the dead rank

    # ------------------------------------------------------------ running

    def run(self, **kw) -> k16.Outcome:
        kw.setdefault("restore", self.newest > 0)
        run = k16.Run(root=self.root, refs=self.refs, logs=self.logs, **kw)
        out = self.launcher.run(run)
        self.walls.append(out.wall_s)
        hung = sorted(r for r, c in out.exit.items() if c is None)
        assert not hung, f"ranks {hung} still ran after {run.timeout_s}s (a hang): {self.tail(out, hung[0])}"
        logs = {r: k16.read_log(t) for r, t in out.logs.items()}
        for r, log in logs.items():
            assert log.mismatch is None, f"rank {r} restored step {self.newest} unlike its save: {log.mismatch}"
        if run.restore:  # every rank but the dead one restored the newest, bit for bit (a peer dead in its own
            # restore, or dying in the saves after, changes nothing of it)
            for r, log in logs.items():
                if r != run.kill_rank:
                    assert log.checked == self.newest, self.tail(out, r)
        return out

    def clean_run(self, steps: int) -> None:
        first = self.newest + 1
        out = self.run(first=first, steps=steps)
        assert set(out.exit.values()) == {0}, self.tail(out, min(r for r, c in out.exit.items() if c))
        self.check(range(first + steps - 1, first + steps) if steps else range(self.newest, self.newest + 1),
                   [s for log in map(k16.read_log, out.logs.values()) for s in log.committed])

    def kill(self, dead: int, *, expect: range, phase=None, store_gone=False, anywhere=False, **kw) -> k16.Outcome:
        """A run in which rank ``dead`` dies; ``expect``: the newest committed step it may leave.  ``anywhere``: at
        a random moment, perhaps inside a collective it had reached: then no survivor can name it (the error says
        every rank had reached it, or names a live rank that had not yet, as such)."""
        out = self.run(kill_rank=dead, **kw)
        self.kills += 1
        assert out.exit[dead] == -signal.SIGKILL, f"rank {dead} was not killed: {self.tail(out, dead)}"
        committed = []
        for r, text in out.logs.items():
            log = k16.read_log(text)
            committed += log.committed
            if r == dead:
                continue
            assert out.exit[r] == 1 and log.failed is not None, self.tail(out, r)
            f, msg = log.failed, log.failed["message"]
            assert f["type"] == "CheckpointError" and msg.startswith(f"layerckpt: rank {r}: "), (r, f)
            if phase is not None:
                assert phase.format(s=kw.get("step")) in msg, (r, msg)
            if store_gone:
                assert STORE_GONE in msg and "rank 0's" in msg, (r, msg)
            elif anywhere:
                assert INSIDE in msg or named(msg), (r, msg)
            else:
                assert dead in named(msg), f"rank {r} was not told that rank {dead} is gone: {msg}"
            self.told["store gone" if STORE_GONE in msg else "died inside" if INSIDE in msg
                      else "the dead rank alone" if named(msg) == {dead}
                      else "the dead rank among others" if dead in named(msg) else "late ranks, not the dead"] += 1
        self.check(expect, committed)
        return out

    # ------------------------------------------------------------ checking the store

    def manifests(self) -> list:
        names = os.listdir(os.path.join(self.root, "manifests"))
        assert all(n.endswith(".json") for n in names), names  # no manifest written halfway
        return sorted(int(n[len("step-"):-len(".json")]) for n in names)

    def check(self, expect: range, committed: list) -> None:
        steps = self.manifests()
        self.known |= set(committed)
        for c in sorted(self.known):  # nothing committed is lost, unless keep_last dropped it for newer ones
            assert c in steps or sum(s > c for s in steps) >= k16.KEEP_LAST, (c, steps)
        newest = max(steps)
        assert newest in expect, f"newest committed step {newest}, expected one of {list(expect)} ({steps})"
        assert not committed or newest >= max(committed)
        self.known |= set(steps)
        self.newest = newest
        assert layerckpt.read_checkpoint(self.root).step == newest
        for s in steps:
            self.read_back(s)

    def read_back(self, step: int) -> None:
        """The model of ``step`` as read from the store, equal bit for bit to every rank's reference."""
        got = layerckpt.read_checkpoint(self.root, step=step).model
        refs = [torch.load(k16.ref_path(self.refs, step, r), weights_only=True)["model"] for r in range(k16.WORLD)]
        for name in k16.ROWS:
            want = torch.cat([ref[name] for ref in refs])
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), (step, name)
        for name in k16.REPLICATED:
            assert all(torch.equal(got[name], ref[name]) for ref in refs), (step, name)

    def leftovers(self) -> set:
        """Data files no manifest references (a torn save's)."""
        referenced = set()
        for s in self.manifests():
            with open(os.path.join(self.root, "manifests", f"step-{s:08d}.json")) as f:
                referenced |= set(json.load(f)["files"])
        return set(os.listdir(os.path.join(self.root, "data"))) - referenced

    @staticmethod
    def tail(out: k16.Outcome, rank: int) -> str:
        return f"rank {rank} (exit {out.exit.get(rank)}):\n{out.logs.get(rank, '')[-4000:]}"


# ------------------------------------------------------------------ the default suite: 10 kills


def test_sixteen_ranks_one_killed_at_each_point_of_a_save(launcher, tmp_path):
    story = Story(launcher, tmp_path)
    story.clean_run(steps=2)
    for point, dead, commits, phase in SAVE_KILLS:
        s = story.newest + 1
        after = point in ("retain.manifests-dropped", k16.SEEN)  # the survivors learn of it at the next save
        story.kill(dead, point=point, first=s, step=s, steps=2 if after else 1, phase=phase,
                   store="rank0" if point == "commit.before" else "launcher", store_gone=point == "commit.before",
                   expect=range(s, s + 1) if commits else range(s - 1, s))
        if point == "commit.latest":  # committed all the same: ``latest`` is a hint, never the commit
            with open(os.path.join(story.root, "latest")) as f:
                assert f.read().strip() == f"step-{s - 1:08d}.json"
        if point in ("flush.checksum", "flush.written"):  # the kill left a torn save for the next open
            assert any(f.startswith(f"step-{s:08d}.") for f in story.leftovers()), story.leftovers()
    # at a random moment of back-to-back saves (after the first commit): the newest reported, or the one after
    s = story.newest + 1
    out = story.kill(10, first=s, steps=20, after=f"COMMITTED {s}", delay_s=0.25, anywhere=True,
                     expect=range(s, s + 20))
    reported = max(c for t in out.logs.values() for c in k16.read_log(t).committed)
    assert story.newest in (reported, reported + 1), (story.newest, reported)
    assert story.kills == 8
    story.clean_run(steps=0)  # sixteen ranks restore the newest bit for bit; the open removes what the kills left
    assert story.leftovers() == set()
    print(f"runs took {story.walls} s; the survivors named {dict(story.told)}")


def test_sixteen_ranks_one_killed_during_a_restore(launcher, tmp_path):
    story = Story(launcher, tmp_path)
    story.clean_run(steps=2)
    before = story.newest
    # the Checkpointer opened first: the survivors restore whole, then learn of the death at their first save
    story.kill(4, point="read.manifest-loaded", first=before + 1, steps=1, phase=AGREEMENT,
               expect=range(before, before + 1))
    # the Checkpointer opened after the restore: its group cannot form without rank 11; the survivors give up
    # at the training's own timeout (init_process_group's), not the half hour of a gloo group's default
    out = story.kill(11, point="read.manifest-loaded", first=before + 1, steps=1, order="restore-first",
                     gloo_timeout_s=6, phase=FORMING, expect=range(before, before + 1))
    assert out.wall_s < 6 + 30, out.wall_s
    story.clean_run(steps=1)
    assert story.kills == 2


# ------------------------------------------------------------------ 100 kills, behind -m slow


@pytest.mark.slow
def test_sixteen_ranks_a_hundred_kills(launcher, tmp_path):
    rng = random.Random(16)
    story = Story(launcher, tmp_path)
    story.clean_run(steps=2)
    kinds = ["point"] * 5 + ["random"] * 3 + ["restore"] * 2
    kills = int(os.environ.get("LAYERCKPT_KILL16_KILLS", "100"))  # .ci/run bounds it to fit CI's time
    while story.kills < kills:
        s = story.newest + 1
        kind = rng.choice(kinds)
        if kind == "point":
            point, commits = rng.choice([("flush.checksum", False), ("flush.written", False), (k16.AGREED, True),
                                         ("commit.before", False), ("commit.latest", True),
                                         ("retain.manifests-dropped", True), (k16.SEEN, True)])
            if point in ("commit.before", "commit.latest", "retain.manifests-dropped"):
                dead = 0  # rank 0's alone: it commits
            else:
                dead = rng.randrange(1 if point in (k16.AGREED, k16.SEEN) else 0, k16.WORLD)
            on_rank0 = dead == 0 and point != "retain.manifests-dropped" and rng.random() < 0.3
            story.kill(dead, point=point, first=s, step=s, steps=2, store="rank0" if on_rank0 else "launcher",
                       store_gone=on_rank0, expect=range(s, s + 1) if commits else range(s - 1, s))
        elif kind == "random":
            out = story.kill(rng.randrange(k16.WORLD), first=s, steps=20, after=f"COMMITTED {s}",
                             delay_s=rng.uniform(0.0, 1.0), anywhere=True, expect=range(s, s + 20))
            reported = max(c for t in out.logs.values() for c in k16.read_log(t).committed)
            assert story.newest in (reported, reported + 1), (story.newest, reported)
        elif rng.random() < 0.8:  # during a restore, at its fault point or at a random moment of it
            if rng.random() < 0.5:
                story.kill(rng.randrange(k16.WORLD), point="read.manifest-loaded", first=s, steps=1,
                           expect=range(s - 1, s))
            else:
                story.kill(rng.randrange(k16.WORLD), first=s, steps=20, after="RESTORING",
                           delay_s=rng.uniform(0.0, 0.3), anywhere=True, expect=range(s - 1, s + 20))
        else:
            story.kill(rng.randrange(k16.WORLD), point="read.manifest-loaded", first=s, steps=1,
                       order="restore-first", gloo_timeout_s=6, phase=FORMING,
                       expect=range(s - 1, s))
    story.clean_run(steps=0)
    assert story.leftovers() == set()
    print(f"{story.kills} kills, runs took {sum(story.walls):.0f} s; the survivors named {dict(story.told)}")
