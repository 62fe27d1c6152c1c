"""The command line's contract: exit 0 when fine, 1 only when verify found damage, 2 for every other error, as
one line on stderr that says what is wrong and how to fix it, never a traceback; 130 when interrupted.
Each rule is checked on `python -m layerckpt.cli` as a new user runs it; every refusal comes before any work."""
import os
import select
import signal
import socket
import stat
import subprocess
import sys

import pytest
import torch

import layerckpt
from layerckpt import cli


def run(*args, env=None, python=("-m", "layerckpt.cli")):
    return subprocess.run([sys.executable, *python, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=env)


def refused(r, *says):
    """Exit 2 and exactly one line on stderr, holding each of ``says``; returns that line."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    for s in says:
        assert s in lines[0], (s, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract") / "ck"
    with layerckpt.Checkpointer(root, torch.nn.Linear(4, 2)) as ck:
        ck.save(1).wait()
    return root


def offline_s3_env(**extra):
    """An environment where S3 has no credentials and no reachable endpoint: nothing leaves the machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1", **extra)
    return env


def test_verify_of_a_remote_without_credentials_exits_2_in_one_line():
    r = run("verify", "s3://bucket/run", env=offline_s3_env())
    line = refused(r, "layerckpt verify: s3://bucket/run cannot be read", "--remote-options")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        assert "s3fs" in line
    else:
        assert "NoCredentialsError" in line


def test_export_onto_an_existing_directory_is_refused_before_any_work(store, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    refused(run("export", store, "-o", out), f"-o {out} is a directory", f"-o {out / 'model.safetensors'}")
    assert list(out.iterdir()) == []


def test_export_onto_a_special_file_is_refused(store, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(run("export", store, "-o", fifo), f"-o {fifo} is not a regular file", "name a file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # neither replaced nor written into


def test_bench_policy_names_an_unknown_workload():
    refused(run("bench", "--policy", "--workloads", "lora", "nope"), "--workloads: no workload named nope",
            "frozen-backbone", "drop --workloads")


def test_bench_cpu_names_an_unknown_model():
    refused(run("bench", "--cpu", "--cpu-models", "main,x"), "--cpu-models: no model named x", "main and/or gpt2-small")


def test_bench_modes_are_exclusive():
    refused(run("bench", "--restore", "--policy"), "layerckpt bench: --policy and --restore are different "
                                                     "benchmarks: give one of them")


def test_an_option_the_mode_ignores_is_refused_by_name():
    refused(run("bench", "--policy", "--preset", "tiny"),
            "--preset does not apply to bench --policy: drop it (--preset is for bench without a mode flag)")


@pytest.mark.parametrize("args, says", [
    (["--policy", "--preset", "tiny"], "--preset does not apply to bench --policy"),
    (["--size", "tiny"], "--size does not apply to bench without a mode flag"),
    (["--policy", "--reps", "2"], "--reps does not apply to bench --policy"),
    (["--sharded", "--config", "c.yaml"], "--config does not apply to bench --sharded"),
    (["--policy", "--chunk-bytes", "4096"], "--chunk-bytes does not apply to bench --policy"),
    (["--restore", "--queue-depth", "8"], "--queue-depth does not apply to bench --restore"),
    (["--cpu", "--only", "dcp"], "--only does not apply to bench --cpu"),
    (["--steps", "--cpu-saves", "8"], "--cpu-saves does not apply to bench --steps"),
    (["--lightning", "--encoding", "off"], "--encoding does not apply to bench --lightning"),
    (["--steps", "--workloads", "lora"], "--workloads does not apply to bench --steps"),
    (["--sharded", "--mesh", "2x2", "--nproc", "4"], "--nproc does not apply with --mesh 2x2"),
])
def test_each_ignored_option_is_named(args, says, capsys):
    """The same rule for every option the task of a mode ignores (in process: the refusal is before any work)."""
    assert cli.main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("layerckpt bench: ") and says in err, err


def test_export_dcp_and_transformers_are_exclusive(store, tmp_path):
    refused(run("export", store, "--dcp", tmp_path / "dcp", "--transformers"),
            "--dcp and --transformers are different outputs: give one of them")
    assert not (tmp_path / "dcp").exists()


def test_export_lightning_and_accelerate_are_exclusive(store, tmp_path):
    refused(run("export", store, "--lightning", "--accelerate", "-o", tmp_path / "x"),
            "--lightning and --accelerate are different outputs")
    assert not (tmp_path / "x").exists()


def test_export_step_with_a_step_folder_is_refused(store, tmp_path):
    refused(run("export", store, "--transformers", "--step", 1, "-o", tmp_path / "x"),
            "--step does not apply to --transformers", "drop --step")


def test_bench_policy_plot_without_matplotlib_exits_2_as_plot_does(tmp_path):
    """Where matplotlib cannot be imported, `bench --policy --plot` refuses before the run with plot's message."""
    python = ("-c", "import sys; sys.modules['matplotlib'] = None; from layerckpt.cli import main; sys.exit(main())")
    out = tmp_path / "frontier.png"
    bench = refused(run("bench", "--policy", "--plot", out, python=python), 'pip install "layerckpt[plot]"')
    assert not out.exists()
    # a fresh process for each: where matplotlib was imported before, blocking it no longer hides it
    plot = refused(run("plot", tmp_path / "none", "-o", out, python=python), 'pip install "layerckpt[plot]"')
    assert bench.split(": ", 1)[1] == plot.split(": ", 1)[1]


def test_every_option_has_help(capsys):
    top = cli._parser()
    parsers = [top] + list(next(a for a in top._actions if a.dest == "cmd").choices.values())
    missing = [f"{p.prog} {a.option_strings or a.dest}" for p in parsers for a in p._actions
               if a.dest != "cmd" and not a.help]
    assert missing == []
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--preset {gpt2-small,tiny}" in out and "(default: gpt2-small)" in out


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout == f"layerckpt {layerckpt.__version__}\n" and r.stderr == ""


def test_a_bad_argument_is_one_line():
    refused(run("bench", "--reps", "0"), "layerckpt bench: argument --reps: 0 is less than 1",
            "(see layerckpt bench --help)")


def test_an_error_without_a_message_of_ours_is_one_line(store, monkeypatch, capsys):
    """safetensors' own error (a file it cannot create under /proc) goes through the same one line."""
    r = run("export", store, "-o", "/proc/self/x.safetensors")
    refused(r, "layerckpt export: SafetensorError", "LAYERCKPT_TRACEBACK=1")
    monkeypatch.setenv("LAYERCKPT_TRACEBACK", "1")  # asked for: the traceback, then the same line
    assert cli.main(["export", str(store), "-o", "/proc/self/x.safetensors"]) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert err.startswith("Traceback") and last.startswith("layerckpt export: SafetensorError") and \
        last.endswith("(not an error layerckpt foresaw: LAYERCKPT_TRACEBACK=1 prints its traceback; please report it)")


def test_verify_exits_0_when_fine_and_2_when_nothing_is_there(store, tmp_path, capsys):
    assert cli.main(["verify", str(store)]) == 0  # damage (exit 1) is tests/test_cli.py's
    assert "1 of 1 checkpoint(s) verified" in capsys.readouterr().out
    refused(run("verify", tmp_path / "nothing"), f"layerckpt verify: checkpoint {tmp_path / 'nothing'} does not exist")


def _sigint_as_a_terminal_would():
    # a shell without job control starts background jobs with SIGINT ignored, and a child inherits that (Python
    # then installs no handler of its own): put back the default so the child hears the signal as a user's ^C
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_exits_130_in_one_line():
    """SIGINT while the command waits on a remote that accepts and never answers (a local socket)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        env = offline_s3_env(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{srv.getsockname()[1]}"
        p = subprocess.Popen([sys.executable, "-m", "layerckpt.cli", "verify", "s3://bucket/run"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_sigint_as_a_terminal_would)
        try:
            assert select.select([srv], [], [], 60)[0], "the command never reached the remote"
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=60)
        finally:
            p.kill()
    assert p.returncode == 130 and err == "layerckpt verify: interrupted\n", (p.returncode, err)
