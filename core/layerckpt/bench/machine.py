"""What every bench's JSON records of where, when and how it ran (one place for every bench)."""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from typing import Any, Dict, Optional

import torch


def machine() -> Dict[str, Any]:
    """What every bench's JSON records of where, when and how it ran: the machine (CPU, cores, RAM, kernel,
    torch), the date (UTC), the commit of the code that ran (``commit_dirty``: with uncommitted changes to
    tracked files; both None outside a git checkout) and the command line."""
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "ram_bytes": mem, "kernel": platform.release(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **_commit(), "command": _command()}


def _commit() -> Dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*a: str) -> Optional[str]:
        try:
            r = subprocess.run(["git", *a], cwd=here, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "commit_dirty": None if dirty is None else bool(dirty)}


def _command() -> str:
    """The command line as given: ``layerckpt bench ...`` (the one torchrun's ranks were launched from, for
    --sharded), else this process's."""
    argv = os.environ.get(_ARGV_ENV)
    if argv:
        return argv
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if prog in ("cli.py", "__main__.py"):
        prog = "layerckpt"
    return shlex.join([prog] + sys.argv[1:])


_ARGV_ENV = "LAYERCKPT_BENCH_COMMAND"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
