"""How a command of :mod:`layerckpt.cli` runs: a URL as DIR read through a local copy, and whatever goes wrong
turned into the exit code and the one line on stderr the command line promises (never a traceback:
LAYERCKPT_TRACEBACK=1 prints one before the line).  Also the check of a figure's path that ``plot`` and
``bench --policy --plot`` share."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback

from .errors import CheckpointCorruptError, CheckpointError


def run(args) -> int:
    """Run the parsed command ``args.fn``: its exit code, or, when it raised, 1 where verify found damage, 130
    where interrupted, and 2 for every other error, said in one line on stderr."""
    try:
        return _on_local_view(args)
    except CheckpointError as e:
        _say(args.cmd, str(e))
        return 1 if args.cmd == "verify" and isinstance(e, CheckpointCorruptError) else 2  # 1: damage found
    except KeyboardInterrupt:
        _say(args.cmd, "interrupted")
        return 130
    except SystemExit as e:  # a bench's own refusal of a value, before its work: the message is its line
        if isinstance(e.code, str):
            _say(args.cmd, e.code)
        return 0 if e.code in (None, 0) else 2
    except Exception as e:  # noqa: BLE001 - the contract: one line, never a traceback
        _say(args.cmd, f"{type(e).__name__}: {e} ({_how(e)})")
        return 2


def _say(cmd: str, text: str) -> None:
    if os.environ.get("LAYERCKPT_TRACEBACK") == "1":
        traceback.print_exc()
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    print(f"layerckpt {cmd}: {line}", file=sys.stderr)


def _how(e: Exception) -> str:
    """How to fix an error that has no message of layerckpt's own."""
    if isinstance(e, IsADirectoryError):
        return "a directory is named where a file is read or written: name a file"
    if isinstance(e, FileNotFoundError):
        return "check the path"
    if isinstance(e, PermissionError):
        return "check the path's permissions, or name another path"
    if isinstance(e, OSError):
        return "check the path and the disk (space, permissions)"
    if isinstance(e, MemoryError):
        return "free memory, or run it where there is more"
    if isinstance(e, ImportError):
        return "install the package named"
    return "not an error layerckpt foresaw: LAYERCKPT_TRACEBACK=1 prints its traceback; please report it"


class Parser(argparse.ArgumentParser):
    """An argument refused: one line on stderr (in place of argparse's usage and error), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _on_local_view(args) -> int:
    """Run the command; a URL as DIR is read through a temporary local copy of what the command reads."""
    from .read._fetch import cli_options, local_view
    from .tiers._remote import is_url

    if not is_url(getattr(args, "dir", None)) or getattr(args, "accelerate", False):
        return args.fn(args)
    what = {"inspect": "manifests", "plot": "manifests", "verify": "all"}.get(args.cmd, "one")
    options = cli_options(args.remote_options)
    with contextlib.ExitStack() as stack:
        try:
            local = stack.enter_context(local_view(args.dir, options, getattr(args, "step", None), what))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - fsspec implementations raise their own types
            raise CheckpointError(f"{args.dir} cannot be read: {type(e).__name__}: {e}; check the URL, and pass "
                                  f"its credentials or endpoint as --remote-options JSON (fsspec options, e.g. "
                                  f"'{{\"key\": ..., \"secret\": ..., \"endpoint_url\": ...}}') or in the "
                                  f"provider's environment") from None
        args.url, args.dir = args.dir, local
        return args.fn(args)


def figure_path(path: str, option: str) -> str:
    """The absolute path of a figure to write at ``path`` (given as ``option``), checked before any work: its
    directory exists, it names a format written, and matplotlib is installed (the message says how to)."""
    from ._plot import _matplotlib

    out = os.path.abspath(path)
    if not os.path.isdir(os.path.dirname(out)):
        raise CheckpointError(f"cannot write {path}: the directory {os.path.dirname(out)} does not exist; "
                              f"create it first")
    if os.path.splitext(out)[1].lower() not in (".png", ".svg", ".pdf"):
        raise CheckpointError(f"{option} {path}: name a .png, .svg or .pdf file")
    try:
        _matplotlib()
    except ImportError as e:
        raise CheckpointError(str(e)) from None
    return out
