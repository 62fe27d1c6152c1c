"""Run under torchrun (2 CPU processes, gloo): plain Trainer uninterrupted, then an attached Trainer stopped
part-way and resumed with resume_from_checkpoint=True, all in these processes; rank 0 writes what
tests/test_transformers.py checks to --out."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import test_transformers as tt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    plain = tt.make(os.path.join(a.dir, "plain"))
    plain.train()
    lc = os.path.join(a.dir, "lc")
    first = tt.make(lc, attach={"full": True}, callbacks=[tt.Stop()])
    try:
        first.train()
    except KeyboardInterrupt:
        pass
    second = tt.make(lc, attach={"full": True})
    second.train(resume_from_checkpoint=True)
    if second.is_world_process_zero():
        with open(a.out, "w") as f:
            json.dump({"world": second.args.world_size, "same": tt.same(second.model, plain.model),
                       "restored": second.layerckpt.last_restore.step,
                       "data": sorted(os.listdir(os.path.join(lc, "layerckpt", "data"))),
                       "folder": sorted(os.listdir(os.path.join(lc, "checkpoint-12")))}, f)


if __name__ == "__main__":
    main()
