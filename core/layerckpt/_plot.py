"""One figure of a store's history, from its manifests alone (no data file is read).

- a heatmap of layers x checkpoints: written by that checkpoint, proven unchanged, or skipped (shaded by
  how many steps the held version trails the checkpoint);
- the bytes each checkpoint wrote, raw and as stored (encoded), against a full checkpoint's;
- the composite's estimated loss increase at each checkpoint (as a share of the training loss).

matplotlib is an optional dependency (``pip install "layerckpt[plot]"``), imported only when a figure is
drawn; the figure is a plain ``matplotlib.figure.Figure`` (no pyplot state, no window).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .format import _store
from .tiers import _tiers
from .format._manifest import Manifest, TensorEntry
from .config import Config
from .errors import CheckpointNotFoundError
from .store import _open_url, _remote_call, is_url

EXTRA = "plot"  # the optional dependency's extra, named in the error without it
#: RGB of a written layer, of one proven unchanged, and the two ends of a skipped one's shade (just behind ..
#: furthest behind)
WRITTEN, UNCHANGED = (0.13, 0.45, 0.71), (0.80, 0.80, 0.80)
SKIPPED_NEAR, SKIPPED_FAR = (1.00, 0.86, 0.60), (0.75, 0.20, 0.05)


def stored_bytes(e: TensorEntry) -> int:
    """Bytes a tensor's entry takes in its own file (encoded: its blocks; else raw)."""
    return sum(b[1] for b in e.enc["blocks"]) if e.enc is not None else e.nbytes


@dataclass
class History:
    """What the figure shows, per checkpoint in commit order (columns) and per layer (rows)."""

    steps: List[int]
    layers: List[str]
    state: np.ndarray  # rows x cols: 0 absent, 1 written, 2 unchanged, 3 skipped
    behind: np.ndarray  # rows x cols: steps the held version trails the checkpoint
    raw: List[int]  # bytes written by each checkpoint, raw
    stored: List[int]  # the same, as stored
    full: List[int]  # a full checkpoint's raw bytes at each
    loss_increase: List[Optional[float]]  # estimated, as a fraction of the training loss


def history(path: str, config: Optional[Config] = None) -> History:
    """The store's committed manifests (a directory or URL), oldest first, as a :class:`History`."""
    p = os.fspath(path)
    if is_url(p):
        good, _ = _remote_call(p, lambda: _tiers.read_all(_open_url(p, config)))
    else:
        good, _ = _store.read_all(_store.local_path(p))
    if not good:
        raise CheckpointNotFoundError(f"no committed checkpoint in {p}: nothing to plot")
    ms = [good[n] for n in sorted(good, key=_store.recency(good))]
    layers: Dict[str, None] = {}
    for m in ms:
        layers.update(dict.fromkeys(m.layers))
    names = list(layers)
    state = np.zeros((len(names), len(ms)), dtype=np.int8)
    behind = np.zeros((len(names), len(ms)), dtype=np.int64)
    row = {n: i for i, n in enumerate(names)}
    for j, m in enumerate(ms):
        for name, e in m.layers.items():
            state[row[name], j] = 1 if e.step == m.step else 2 if e.unchanged or e.reason == "unchanged" else 3
            behind[row[name], j] = m.step - e.step
    raw, stored = zip(*(_written(m) for m in ms))
    return History([m.step for m in ms], names, state, behind, list(raw), list(stored),
                   [sum(e.nbytes for e in m.tensors.values()) for m in ms], [m.loss_increase for m in ms])


def _written(m: Manifest) -> Tuple[int, int]:
    """(raw, stored) bytes of the tensors this checkpoint wrote: those in its own files."""
    mine = [e for e in m.tensors.values() if e.file in m.files and m.files[e.file].step == m.step]
    return sum(e.nbytes for e in mine), sum(stored_bytes(e) for e in mine)


def behind_range(h: History) -> Tuple[int, int]:
    """(least, most) steps a skipped layer trails its checkpoint: the two ends of the skipped shade."""
    b = h.behind[h.state == 3]
    return (int(b.min()), int(b.max())) if b.size else (0, 0)


def colors(h: History, max_rows: int) -> Tuple[np.ndarray, List[Tuple[int, int]]]:
    """The heatmap's RGB image, layers aggregated into at most ``max_rows`` rows (a row's colour the mean of
    its layers'), and each row's [first, end) layer range."""
    near, far = behind_range(h)
    t = (np.clip(h.behind - near, 0, None) / max(far - near, 1))[..., None]
    rgb = np.ones(h.state.shape + (3,))
    rgb[h.state == 1] = WRITTEN
    rgb[h.state == 2] = UNCHANGED
    skipped = h.state == 3
    shade = (1 - t) * np.array(SKIPPED_NEAR) + t * np.array(SKIPPED_FAR)
    rgb[skipped] = shade[skipped]
    n = len(h.layers)
    groups = max(1, min(n, max_rows))
    edges = np.linspace(0, n, groups + 1).round().astype(int)
    spans = [(int(a), int(b)) for a, b in zip(edges, edges[1:]) if b > a]
    return np.stack([rgb[a:b].mean(axis=0) for a, b in spans]), spans


def figure(h: History, title: str = "", max_rows: int = 64) -> Any:
    """The figure of ``h``: heatmap on the left, bytes and loss increase on the right."""
    Figure = _matplotlib()
    fig = Figure(figsize=(13, max(5.0, min(12.0, 2.5 + 0.12 * min(len(h.layers), max_rows)))), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=[3, 2])
    _heatmap(fig.add_subplot(grid[:, 0]), h, max_rows)
    _bytes(fig.add_subplot(grid[0, 1]), h)
    _loss(fig.add_subplot(grid[1, 1]), h)
    if title:
        fig.suptitle(title)
    return fig


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"layerckpt's plot needs matplotlib, an optional dependency: pip install "
                          f"\"layerckpt[{EXTRA}]\" (or pip install matplotlib) ({e})") from None
    return Figure


def _heatmap(ax: Any, h: History, max_rows: int) -> None:
    from matplotlib.patches import Patch

    img, spans = colors(h, max_rows)
    ax.imshow(img, aspect="auto", interpolation="nearest")
    label = [h.layers[a] if b - a == 1 else f"{h.layers[a]} .. {h.layers[b - 1]} ({b - a})" for a, b in spans]
    rows = _sparse(len(spans), 24)
    ax.set_yticks(rows, [label[i] for i in rows], fontsize=7)
    cols = _sparse(len(h.steps), 12)
    ax.set_xticks(cols, [str(h.steps[j]) for j in cols], rotation=45, fontsize=7)
    ax.set_xlabel("checkpoint (step)")
    aggregated = "" if len(spans) == len(h.layers) else f", {len(h.layers)} layers in {len(spans)} rows"
    ax.set_title(f"layers x checkpoints{aggregated}", fontsize=10)
    near, far = behind_range(h)
    ax.legend(handles=[Patch(color=WRITTEN, label="written"), Patch(color=UNCHANGED, label="unchanged (proven)"),
                       Patch(color=SKIPPED_NEAR, label=f"skipped, {near} steps behind"),
                       Patch(color=SKIPPED_FAR, label=f"skipped, {far} steps behind")],
              loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, fontsize=7, frameon=False)


def _bytes(ax: Any, h: History) -> None:
    x = np.arange(len(h.steps))
    ax.bar(x - 0.2, np.array(h.raw) / 1e6, width=0.4, label="written, raw", color=(0.55, 0.70, 0.85))
    ax.bar(x + 0.2, np.array(h.stored) / 1e6, width=0.4, label="written, stored", color=WRITTEN)
    ax.step(x, np.array(h.full) / 1e6, where="mid", color="black", linewidth=1, label="full checkpoint, raw")
    cols = _sparse(len(h.steps), 12)
    ax.set_xticks(cols, [str(h.steps[j]) for j in cols], rotation=45, fontsize=7)
    ax.set_ylabel("MB")
    ax.set_ylim(0, 1.4 * max(max(h.full), max(h.raw), 1) / 1e6)  # room above the bars for the legend
    ax.set_title("bytes per checkpoint", fontsize=10)
    ax.legend(fontsize=7, loc="upper right", ncol=3, frameon=False)


def _loss(ax: Any, h: History) -> None:
    known = [(s, v) for s, v in zip(h.steps, h.loss_increase) if v is not None]
    if known:
        s, v = zip(*known)
        ax.plot(s, [100 * x for x in v], marker=".", color=SKIPPED_FAR)
    else:
        ax.text(0.5, 0.5, "no training loss recorded\n(save(..., loss=) sets it)", ha="center", va="center",
                transform=ax.transAxes, fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("% of the training loss")
    ax.set_title("composite's estimated loss increase", fontsize=10)


def _sparse(n: int, most: int) -> List[int]:
    """At most ``most`` evenly spread indices of ``n`` (always the first and the last)."""
    if n <= most:
        return list(range(n))
    return sorted(set(np.linspace(0, n - 1, most).round().astype(int).tolist()))


def plot(path: Any, *, config: Optional[Config] = None, max_rows: int = 64) -> Any:
    """A matplotlib ``Figure`` of the store ``path`` (a directory or a remote tier's URL, read with
    ``config.remote_options``): which layers each checkpoint wrote, skipped or proved unchanged, the bytes it
    wrote (raw and stored) against a full checkpoint, and the composite's estimated loss increase.  Read from
    the manifests alone.  More than ``max_rows`` layers are drawn as that many rows of consecutive layers.
    Needs matplotlib (``pip install "layerckpt[plot]"``); ``fig.savefig("history.png")`` writes it."""
    _matplotlib()  # the missing dependency is named before any store is read
    return figure(history(path, config), title=os.fspath(path), max_rows=max_rows)
