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
