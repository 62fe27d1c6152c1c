"""Row blocks: embedding tables persisted a block of rows at a time.

A batch touches few rows of a large embedding table, so most of the table barely
moves between checkpoints.  Each table (the weight of an ``nn.Embedding`` or
``nn.EmbeddingBag`` at least two blocks big) is cut into blocks of
``Config.row_block_bytes`` worth of rows, and each block, with the same rows of its
optimizer state (every state tensor of the table's shape), is a layer of its own:
the selection persists only the blocks whose rows moved enough.

A table tied to an output layer (a language model's head) is not cut: through the
softmax every row of it gets a gradient at every step, and Adam moves each element by
about the learning rate whatever that gradient's size, so the rows of tokens no batch
holds move as fast as the others.  Left stale, such rows kept shifting the training
long after a restore whose first-order cost was within the fidelity budget
(docs/selection.md: a fine-tune 0.17-0.71% off ten to forty steps later, 0.00-0.06%
with the table whole).

A block is stored as a tensor of its own, keyed ``<tensor key>#rows=<a>:<b>``; the
manifest's ``blocks`` names every table stored so (dtype, shape, row ranges), and
readers assemble the whole tensor from its blocks, reading each straight into its
rows.  The optimizer state and model metadata keep referring to the whole tensor.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..format._codec import Entries
from ..format._layout import DTYPES
from ..format._manifest import MODEL, OPTIM, RowBlocks, piece_key

def table_names(model: torch.nn.Module, block_bytes: int) -> Dict[str, int]:
    """State_dict names of the embedding tables worth cutting -> rows per block; a table that is also another
    module's parameter (a tied head) is not one."""
    if block_bytes <= 0:
        return {}
    out: Dict[str, int] = {}
    tables, tied = set(), set()  # one walk of the modules (this runs at every selective save)
    for m in model.modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            tables.add(id(m.weight))
        else:
            tied.update(id(p) for p in m.parameters(recurse=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in tables or id(p) in tied or p.dim() != 2 or p.shape[0] < 2:
            continue
        row = p.shape[1] * p.element_size()
        rows = max(1, block_bytes // max(row, 1))
        if p.shape[0] >= 2 * rows:
            out[name] = rows
    return out


def split(entries: Entries, tables: Dict[str, int]) -> Tuple[Entries, Dict[str, RowBlocks]]:
    """Cut the tables' weights, and their optimizer state of the same shape, into row blocks.
    Returns the new entries and the manifest's ``blocks`` record."""
    if not tables:
        return entries, {}
    shapes = {n: None for n in tables}
    for k, t in entries:
        if k.startswith(MODEL) and k[len(MODEL):] in tables:
            shapes[k[len(MODEL):]] = tuple(t.shape)
    out: Entries = []
    blocks: Dict[str, RowBlocks] = {}
    for k, t in entries:
        name = _table_of(k)
        rows = tables.get(name) if name is not None else None
        if rows is None or shapes.get(name) is None or tuple(t.shape) != shapes[name]:
            out.append((k, t))
            continue
        ranges = [[a, min(a + rows, t.shape[0])] for a in range(0, t.shape[0], rows)]
        blocks[k] = RowBlocks(dtype=DTYPES[t.dtype], shape=list(t.shape), rows=ranges)
        out.extend((piece_key(k, a, b), t[a:b]) for a, b in ranges)
    return out, blocks


def _table_of(key: str) -> Optional[str]:
    """The parameter a model or optimizer-state key belongs to (the tables are parameters)."""
    if key.startswith(MODEL):
        return key[len(MODEL):]
    if key.startswith(OPTIM):
        parts = key.split("/", 2)
        return parts[1] if len(parts) == 3 else None
    return None
