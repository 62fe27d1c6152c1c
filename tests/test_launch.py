"""``layerckpt launch``: a job killed with SIGKILL restarts from the warm standby (a fork of a process that has
imported torch), resumes from its checkpoint and ends bit for bit as an uninterrupted run; the restarts, their
limit, exit statuses, signals and the fallback to a new interpreter are what the command line says; an attempt dies
with its launcher, however the launcher dies."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standby_job.py")


def launch(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "layerckpt.cli", "launch", *args], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, **(env or {})), **kw)


def attempts(root):
    with open(os.path.join(root, "attempts.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_killed_job_restarts_warm_and_ends_as_the_uninterrupted_run(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    r = launch("--max-restarts", "0", JOB, str(ref))
    assert r.returncode == 0, r.stderr
    r = launch(JOB, str(run), "--kill-at", "5")
    assert r.returncode == 0, r.stderr
    assert "the job ended (killed by SIGKILL)" in r.stderr and "restart 1 of 3, from the warm standby" in r.stderr
    assert "restart 2" not in r.stderr
    a = attempts(run)
    assert [x["restart"] for x in a] == [0, 1] and [x["start"] for x in a] == [0, 4]
    assert all(x["preloaded"] for x in a)  # forks: torch was imported before the script's first line
    assert all(x["name"] == "__main__" and x["argv0"] == JOB for x in a)
    # each attempt's global generators seeded anew, as in a new interpreter (a fork would repeat the parent's)
    assert a[0]["torch_rand"] != a[1]["torch_rand"] and a[0]["random"] != a[1]["random"]
    want, got = torch.load(ref / "final.pt", weights_only=True), torch.load(run / "final.pt", weights_only=True)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, st in want["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][i][k], v), (i, k)


def test_no_standby_starts_each_attempt_in_a_new_interpreter(tmp_path):
    r = launch("--no-standby", JOB, str(tmp_path), "--kill-at", "3")
    assert r.returncode == 0, r.stderr
    assert "restart 1 of 3" in r.stderr and "warm standby" not in r.stderr
    a = attempts(tmp_path)
    assert [x["start"] for x in a] == [0, 2] and not any(x["preloaded"] for x in a)


def test_restarts_run_out_with_the_jobs_status(tmp_path):
    r = launch("--max-restarts", "2", JOB, str(tmp_path), "--exit", "3")
    assert r.returncode == 3
    assert [x["restart"] for x in attempts(tmp_path)] == [0, 1, 2]
    assert r.stderr.count("the job ended (exit status 3)") == 3 and "after 2 restart(s); giving up" in r.stderr


def test_a_script_that_raises_prints_its_traceback_and_exits_1(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise RuntimeError('boom at step 3')\n")
    r = launch("--max-restarts", "1", str(script))
    assert r.returncode == 1
    assert r.stderr.count("RuntimeError: boom at step 3") == 2 and "Traceback" in r.stderr
    script.write_text("import sys\nsys.exit('no data found')\n")
    r = launch("--max-restarts", "0", str(script))
    assert r.returncode == 1 and r.stderr.startswith("no data found")


def test_a_module_runs_as_python_dash_m(tmp_path):
    (tmp_path / "jobmod.py").write_text("import sys\nprint('ran', __name__, sys.argv[1:])\n")
    r = launch("-m", "jobmod", "--", "--lr", "3", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ran __main__ ['--lr', '3']"


def test_refusals_are_one_line(tmp_path):
    r = launch(str(tmp_path / "missing.py"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"layerckpt launch: no script at {str(tmp_path / 'missing.py')!r}: name a Python " \
                               f"file, or -m MODULE"
    r = launch("--max-restarts", "2")
    assert r.returncode == 2 and r.stderr.startswith("layerckpt launch: no script named: layerckpt launch [options]")
    (tmp_path / "ok.py").write_text("")
    r = launch("--preload", "no_such_module_here", str(tmp_path / "ok.py"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--preload no_such_module_here: the module does not import here" in r.stderr
    r = launch("--max-restarts", "-1", str(tmp_path / "ok.py"))
    assert r.returncode == 2 and "--max-restarts must be 0 or more, got -1" in r.stderr


def test_a_preloaded_module_that_starts_a_thread_makes_every_attempt_a_new_interpreter(tmp_path):
    (tmp_path / "threaded.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    r = launch("--preload", "threaded", JOB, str(tmp_path), "--kill-at", "3", env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "every attempt starts a new interpreter: 1 Python thread(s) run beside the launcher's own" in r.stderr
    a = attempts(tmp_path)
    assert [x["start"] for x in a] == [0, 2] and not any(x["preloaded"] for x in a)


def test_sigterm_reaches_the_attempt_and_stops_the_restarts(tmp_path):
    script = tmp_path / "sleepy.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-m", "layerckpt.cli", "launch", str(script)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and time.monotonic() - t < 30
    assert "restart" not in err


def _alive(pid):
    """Whether ``pid`` runs: a zombie (dead, not yet reaped by the process it was reparented to) does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _gone_within(pid, seconds):
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _alive(pid)


def _await(path, p, seconds=120):
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    assert path.exists(), f"nothing at {path}: the launcher exited with status {p.poll()}"
    return path.read_text()


SLEEPER = """import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {'torch' in sys.modules}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


@pytest.mark.parametrize("standby", [True, False], ids=["forked", "new_interpreter"])
def test_a_launcher_killed_with_sigkill_takes_its_attempt_with_it(tmp_path, standby):
    """The attempt, a fork of the launcher or a new interpreter, dies with its launcher: no orphan trains on (the
    launcher is the standby itself, so the attempt is the one process it started)."""
    script, told = tmp_path / "job.py", tmp_path / "pid"
    script.write_text(SLEEPER)
    with open(tmp_path / "launch.log", "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "layerckpt.cli", "launch", *([] if standby else ["--no-standby"]),
                              str(script), str(told)], stdout=log, stderr=subprocess.STDOUT)
    pid = None
    try:
        text = _await(told, p)
        pid, preloaded = int(text.split()[0]), text.split()[1] == "True"
        assert preloaded == standby and _ppid(pid) == p.pid  # a fork, or a new interpreter; the launcher's child
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        assert _gone_within(pid, 5), "the attempt outlived its launcher"
    finally:
        for q in (p.pid, pid):
            if q is not None and _alive(q):
                os.kill(q, signal.SIGKILL)
        p.wait()


HARNESS = """
import os, sys, time
import layerckpt.launch as L

ready, tie = sys.argv[1], L._die_with

def held(launcher):  # the attempt held between its fork and its tie to the launcher, as a slow machine may hold it
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(ready + ".tmp", ready)
    while os.getppid() == launcher:
        time.sleep(0.005)
    tie(launcher)

L._die_with = held
sys.exit(L.launch(sys.argv[3:], max_restarts=0, standby=sys.argv[2] == "standby"))
"""


@pytest.mark.parametrize("standby", [True, False], ids=["forked", "new_interpreter"])
def test_an_attempt_started_as_its_launcher_dies_never_runs(tmp_path, standby):
    """An attempt whose launcher died between its fork and its tie to the launcher (when the kernel has no death
    left to tell it of) finds its parent changed and dies before its script's first line."""
    script, ran, ready = tmp_path / "job.py", tmp_path / "ran", tmp_path / "ready"
    script.write_text("import sys\nopen(sys.argv[1], 'w').close()\n")
    p = subprocess.Popen([sys.executable, "-c", HARNESS, str(ready), "standby" if standby else "fresh", str(script),
                          str(ran)])
    pid = None
    try:
        pid = int(_await(ready, p))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        assert _gone_within(pid, 5), "the attempt outlived its launcher"
        assert not ran.exists()
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        p.wait()
