"""The native ring and CRC32C tested in plain C (csrc/tests/test_ring.c), under ASan/UBSan where gcc has them."""
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / "tests" / "test_ring.c", CSRC / "ring.c", CSRC / "sys.c", CSRC / "crc32c.c"]
FLAGS = ["-Wall", "-Werror", "-std=gnu11", "-g"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
SKIP = 77


def _sanitizers_work(gcc: str, tmp_path: Path) -> bool:
    """gcc links and runs a trivial program with the sanitizers (needs libasan/libubsan)."""
    src, exe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text("int main(void) { return 0; }\n")
    try:
        subprocess.run([gcc, *SANITIZE, str(src), "-o", str(exe)], check=True, capture_output=True, timeout=60)
        subprocess.run([str(exe)], check=True, capture_output=True, timeout=60)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return False
    return True


def test_ring_in_c(tmp_path):
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    if not all(p.exists() for p in SOURCES):
        pytest.skip("the C sources are not in this checkout")
    flags = FLAGS + (SANITIZE if _sanitizers_work(gcc, tmp_path) else [])
    exe = tmp_path / "test_ring"
    build = subprocess.run([gcc, *flags, *map(str, SOURCES), "-o", str(exe)], capture_output=True, text=True,
                           timeout=120)
    assert build.returncode == 0, f"{' '.join(flags)}\n{build.stdout}{build.stderr}"
    run = subprocess.run([str(exe), str(tmp_path)], capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    if run.returncode == SKIP:
        pytest.skip(out.strip())
    assert run.returncode == 0, out
    assert "all ok" in run.stdout, out


# ------------------------------------------------------------------ the Python module's build

ROOT = CSRC.parent


def _setup_py():
    """The package build's C flags and the module's sources, as setup.py states them (read, not run: running
    it would build)."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    flags = next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "CFLAGS" for t in n.targets))
    sources = next(ast.literal_eval(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and getattr(n.func, "id", None) == "Extension" for k in n.keywords if k.arg == "sources")
    return flags, sources


def test_the_module_compiles_without_a_warning(tmp_path):
    """The package builds with -Wall only, so that a warning a newer compiler adds never costs a user the native
    writer; here the same sources and flags with -Werror: a new warning fails this test instead."""
    import sysconfig

    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    flags, sources = _setup_py()
    assert "-Wall" in flags and "-Werror" not in flags, flags
    include = sysconfig.get_paths()["include"]
    for src in sources:
        obj = tmp_path / (Path(src).stem + ".o")
        r = subprocess.run([gcc, *flags, "-Werror", "-fPIC", "-I", include, "-c", str(ROOT / src), "-o", str(obj)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{src}:\n{r.stdout}{r.stderr}"


def test_a_failed_build_says_why_where_the_module_would_be(tmp_path):
    """A compiler that fails: the install goes on (the threads backend), pip's output warns, and the reason is kept
    beside where the module would be, for native_missing() to tell the tests and the user."""
    import sys

    from layerckpt.io._backend import native_missing

    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(CSRC, tmp_path / "csrc")
    (tmp_path / "core" / "layerckpt" / "io").mkdir(parents=True)
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'cc: error: no compiler here' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "CC": str(fake_cc)})
    assert r.returncode == 0, r.stdout + r.stderr  # the install is not refused
    assert "the native writer was not built" in r.stderr, r.stderr
    record = tmp_path / "core" / "layerckpt" / "io" / "_uring.unbuilt"
    assert record.exists(), sorted(str(p) for p in tmp_path.rglob("*unbuilt*"))
    assert "exit status 1" in record.read_text() or "failed" in record.read_text(), record.read_text()
    assert not list((tmp_path / "core" / "layerckpt" / "io").glob("_uring*.so"))
    # in a process where the module is missing, that reason is what the tests and `doctor` are told
    import layerckpt.io._backend as B

    saved = B._uring
    try:
        B._uring = None
        why = native_missing(str(record))
    finally:
        B._uring = saved
    assert why.startswith("the native module layerckpt.io._uring failed to build (") and \
        record.read_text().strip() in why, why


def test_a_missing_native_module_fails_the_tests_that_need_it_on_linux(monkeypatch):
    """On Linux the native tests fail (with the build's reason) where the module is missing, instead of skipping:
    a broken build cannot pass as green. LAYERCKPT_TESTS_WITHOUT_NATIVE=1 opts out, for a platform without it."""
    import sys

    import conftest

    why = "the native module layerckpt.io._uring failed to build (CompileError: command 'cc' failed)"
    monkeypatch.setattr(conftest, "native_missing", lambda: why)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv(conftest.WITHOUT_NATIVE, raising=False)
    with pytest.raises(pytest.fail.Exception, match=r"the native CRC32C needs the native module: .*cc' failed\)"):
        conftest.require_native("the native CRC32C")
    monkeypatch.setenv(conftest.WITHOUT_NATIVE, "1")
    with pytest.raises(pytest.skip.Exception, match="cc' failed"):
        conftest.require_native("the native CRC32C")
    monkeypatch.delenv(conftest.WITHOUT_NATIVE)
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(pytest.skip.Exception):
        conftest.require_native("the native CRC32C")
    monkeypatch.setattr(conftest, "native_missing", lambda: None)
    conftest.require_native("the native CRC32C")  # built: nothing said
