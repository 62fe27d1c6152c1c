"""Encode and decode rates of Config(encoding='lossy')'s block codes (layerckpt/format/_qblock.py) on an AdamW
state of 64 MiB per kind (16 linear layers of 1024 x 1024, random gradients, lr 1e-4), in 1 MiB blocks, the best
of three passes on 1 and 2 threads:

- ``exp_avg_sq`` told against its reference 5 steps before (QSQREF), and as its own codes (QSQ);
- weight deltas against a reference 5 and 200 steps before (QDELTA: codes 1 byte wide, and 2 bytes split at
  4 bits).

    python benchmarks/lossy_rates.py
"""
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from layerckpt.format import _qblock as Q

BLOCK = 1 << 18  # fp32 elements: 1 MiB


def state():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(16)]
    params = [layer.weight for layer in layers]
    opt = torch.optim.AdamW(params, lr=1e-4)
    snap = {}
    for s in range(1, 206):
        opt.zero_grad()
        for p in params:
            (p * torch.randn_like(p)).sum().backward()
        opt.step()
        if s in (5, 200, 205):
            snap[s] = ([p.detach().numpy().copy() for p in params],
                       [opt.state[p]["exp_avg_sq"].numpy().copy() for p in params])
    return snap


def blocks(arrays):
    return [a.reshape(-1)[i:i + BLOCK] for a in arrays for i in range(0, a.size, BLOCK)]


def best(fn, items, threads, nbytes):
    """(GB/s over ``nbytes``, the outputs) of the best of three passes of ``fn`` over ``items``."""
    t_best, out = float("inf"), None
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(3):
            t = time.perf_counter()
            out = list(ex.map(fn, items))
            t_best = min(t_best, time.perf_counter() - t)
    return nbytes / t_best / 1e9, out


def decode(item):
    mode, data, ref = item
    out = ref.copy().view(np.uint8)  # a restore puts the reference's bytes where the block decodes
    Q.decode(mode, memoryview(data), out, "bench")
    return out


def main():
    snap = state()
    cases = (("exp_avg_sq, told against its reference 5 steps before", "qsq", snap[205][1], snap[200][1], 0),
             ("exp_avg_sq, its own codes", "qsq", snap[205][1], None, 0),
             ("weight deltas, reference 5 steps before", "qdelta", snap[205][0], snap[200][0], 5),
             ("weight deltas, reference 200 steps before", "qdelta", snap[205][0], snap[5][0], 200))
    for name, code, new, ref, steps in cases:
        news = blocks(new)
        refs = blocks(ref) if ref is not None else [None] * len(news)
        if code == "qsq" and ref is not None:  # a second moment's reference is what its own codes restore to
            refs = [Q.encode("qsq", r.view(np.uint8), None, 2.0, 1, 4)[2].view(np.float32) for r in refs]
        items = list(zip(news, refs))

        def enc(it):
            return Q.encode(code, it[0].view(np.uint8), None if it[1] is None else it[1].view(np.uint8), 2.0, steps, 4)

        raw = sum(x.nbytes for x in news)
        one, out = best(enc, items, 1, raw)
        two, _ = best(enc, items, 2, raw)
        ratio = raw / sum(len(o[1]) for o in out)
        dec = [(o[0], o[1], r if r is not None else np.zeros_like(x)) for o, x, r in zip(out, news, refs)]
        back, got = best(decode, dec, 2, raw)
        assert all(np.array_equal(g, o[2]) for g, o in zip(got, out)), "a block decoded to other bytes"
        print(f"{name}: encode {two:.2f} GB/s on 2 threads, {one:.2f} on 1; decode {back:.2f} GB/s on 2 threads; "
              f"{ratio:.1f}x smaller than fp32; modes {sorted({o[0] for o in out})}")


if __name__ == "__main__":
    main()
