"""Every measured table in README.md and docs/*.md, rendered from its JSON under ``benchmarks/``.

A table in the docs sits between two markers naming the JSON it comes from, and how to show it::

    <!-- table: benchmarks/steps-gpt2-small-2core-xeon.json steps -->
    ```
    ...what the bench's own formatter prints from that JSON...
    ```
    <!-- /table -->

``python -m layerckpt.bench.report --write`` renders each table from its JSON with the formatter of the bench
that wrote it (the same text the command prints without ``--json``) and writes it between the markers;
``--check`` changes nothing and exits 1 listing every table that differs from what its JSON renders (the docs'
test runs it).  A re-run of a bench replaces the JSON; ``--write`` then replaces its tables.

Views (the marker's second word; without one, the view is told from the JSON's keys):

===================  ==========================================================================================
``run``              ``layerckpt bench`` (``run.format_table``)
``selective``        its selective saves and fine-tuning overhead alone (``run.format_selective``)
``tiers``            its tiers' lines alone (``tiers.format_tiers``)
``restore``          ``layerckpt bench --restore``
``steps``            ``layerckpt bench --steps``
``sharded``          ``layerckpt bench --sharded``
``lightning``        ``layerckpt bench --lightning``
``cpu``              ``layerckpt bench --cpu``
``policy``           ``layerckpt bench --policy`` (both tables, and the adapters' where ``--through`` named some)
``through``          ``layerckpt bench --policy --through ...``: the adapters' table alone
``lossy``            ``layerckpt bench --lossy``
``goodput``          ``layerckpt bench --goodput`` (``goodput_report.format_table``)
``goodput-summary``  its README summary: each contender at its best cadence, lost time split, targets
``main-job``         ``examples/lightning_finetune.py --json`` (``main_job.format_table``)
``nodes``            ``layerckpt bench --nodes``
===================  ==========================================================================================
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

OPEN = re.compile(r"^<!-- table: (?P<path>\S+\.json)(?: (?P<view>[\w-]+))? -->[ \t]*$", re.M)
CLOSE = "<!-- /table -->"


def _call(module: str, fn: str) -> Callable[[Dict[str, Any]], str]:
    def render(res: Dict[str, Any]) -> str:
        return getattr(importlib.import_module(f"layerckpt.bench.{module}"), fn)(res)
    return render


def _tiers(res: Dict[str, Any]) -> str:
    from .tiers import format_tiers

    return format_tiers(res["tiers"], res["state_bytes"] / 1e9)


#: view -> the formatter that renders a JSON of it
VIEWS: Dict[str, Callable[[Dict[str, Any]], str]] = {
    "run": _call("run", "format_table"),
    "selective": _call("run", "format_selective"),
    "tiers": _tiers,
    "restore": _call("restore", "format_table"),
    "steps": _call("steps", "format_table"),
    "sharded": _call("sharded", "format_table"),
    "lightning": _call("lightning_io", "format_table"),
    "cpu": _call("cpu", "format_table"),
    "policy": _call("policy", "format_report"),
    "through": _call("policy", "format_through"),
    "lossy": _call("lossy", "format_table"),
    "goodput": _call("goodput_report", "format_table"),
    "goodput-summary": _call("goodput_report", "format_summary"),
    "main-job": _call("main_job", "format_table"),
    "nodes": _call("nodes", "format_table"),
}


def view_of(res: Dict[str, Any]) -> str:
    """The view a marker without one gets, told from the JSON's keys (the bench that wrote it)."""
    if "main_job" in res:
        return "main-job"
    if res.get("bench") == "nodes":
        return "nodes"
    if "rows" in res and res.get("lossy"):
        return "lossy"
    if "rows" in res:
        return "policy"
    if "mtbf_s" in res and "free" in res:
        return "goodput"
    if "world" in res and "saves" in res:
        return "sharded"
    if "conditions" in res and "sizes" in res:
        return "restore"
    if "torch_threads" in res and "models" in res:
        return "cpu"
    if "warmup" in res and "runs" in res:
        return "steps"
    if "tensors" in res and "reference" in res:
        return "lightning"
    if "disk" in res and "runs" in res:
        return "run"
    raise ValueError("no view fits its keys; name one in the marker: " + ", ".join(VIEWS))


def render(root: str, path: str, view: Optional[str] = None) -> str:
    """The block between a table's markers: the formatter's text of ``root/path`` in a code fence."""
    with open(os.path.join(root, path), encoding="utf-8") as f:
        res = json.load(f)
    name = view or view_of(res)
    if name not in VIEWS:
        raise ValueError(f"unknown view {name!r}; one of " + ", ".join(VIEWS))
    text = VIEWS[name](res).rstrip("\n")
    return f"```\n{text}\n```\n"


@dataclass
class Table:
    page: str  # relative to the root
    line: int  # of the opening marker, 1-based
    path: str  # the JSON, relative to the root
    view: Optional[str]
    start: int  # offsets of the block between the markers
    end: int


def pages(root: str) -> List[str]:
    """README.md and docs/*.md under ``root``, relative to it."""
    found = ["README.md"] if os.path.exists(os.path.join(root, "README.md")) else []
    return found + sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))


def tables(page: str, text: str) -> Tuple[List[Table], List[str]]:
    """The marked tables of one page, and what is wrong with its markers."""
    out, errors = [], []
    for m in OPEN.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        start = m.end() + 1
        end = text.find("\n" + CLOSE, m.end())
        nxt = OPEN.search(text, m.end())
        if end < 0 or (nxt and nxt.start() < end):
            errors.append(f"{page}:{line}: {m.group('path')}: no {CLOSE} before the next table or the end")
            continue
        out.append(Table(page, line, m.group("path"), m.group("view"), min(start, end + 1), end + 1))
    return out, errors


def run(root: str, write: bool) -> Tuple[List[str], List[str], int]:
    """Render every marked table under ``root``; with ``write``, put each into its page.  Returns the tables that
    differ from their JSON (with ``write``: that were rewritten), the markers or JSON that are broken, one line
    each, and how many tables there are."""
    differ, broken, count = [], [], 0
    for page in pages(root):
        full = os.path.join(root, page)
        with open(full, encoding="utf-8") as f:
            text = f.read()
        found, errors = tables(page, text)
        broken += errors
        count += len(found)
        new, at = [], 0
        for t in found:
            try:
                block = render(root, t.path, t.view)
            except (OSError, ValueError, KeyError, TypeError) as e:
                broken.append(f"{t.page}:{t.line}: {t.path}: cannot render ({type(e).__name__}: {e})")
                continue
            if text[t.start:t.end] != block:
                differ.append(f"{t.page}:{t.line}: {t.path}" + (f" ({t.view})" if t.view else "")
                              + (": rewritten from its JSON" if write else ": differs from what its JSON renders"))
                new += [text[at:t.start], block]
                at = t.end
        if write and new:
            with open(full, "w", encoding="utf-8") as f:
                f.write("".join(new) + text[at:])
    return differ, broken, count


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerckpt.bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true", help="render every marked table into its page")
    g.add_argument("--check", action="store_true", help="exit 1 listing the tables that differ from their JSON")
    p.add_argument("--root", default=".", help="the checkout holding README.md, docs/ and benchmarks/ (default: .)")
    a = p.parse_args(argv)
    if not os.path.isdir(os.path.join(a.root, "benchmarks")):
        print(f"{a.root}: no benchmarks/ folder here; run from the checkout or give --root", file=sys.stderr)
        return 2
    differ, broken, count = run(a.root, a.write)
    for line in broken:
        print(line, file=sys.stderr)
    if a.check:
        for line in differ:
            print(line, file=sys.stderr)
        if differ or broken:
            print(f"{len(differ)} of {count} tables differ from their JSON, {len(broken)} broken; "
                  f"python -m layerckpt.bench.report --write renders them", file=sys.stderr)
            return 1
        print(f"{count} tables match their JSON")
        return 0
    for line in differ:
        print(line)
    print(f"{count} tables, {len(differ)} rewritten, {len(broken)} broken")
    return 1 if broken else 0

if __name__ == "__main__":
    sys.exit(main())
