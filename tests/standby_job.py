"""A training job for tests/test_launch.py, run by ``layerckpt launch``: ``standby_job.py ROOT [--kill-at K]
[--exit CODE]``.  A tiny GPT trained 8 steps with AdamW, a full checkpoint every 2 steps in ``ROOT/ckpt``,
resumed from the newest one; the first attempt (``LAYERCKPT_RESTART_COUNT`` 0) SIGKILLs itself after step K.
Each attempt appends a line of JSON to ``ROOT/attempts.jsonl`` (its restart count, whether torch was imported
before the script's first line, draws of the global generators, the step it starts from); the finished run
writes its model and optimizer state to ``ROOT/final.pt``.  ``--exit CODE`` instead ends every attempt with
that status at once."""
import sys

PRELOADED = "torch" in sys.modules  # noqa: E402 - before the script's own imports

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402

import layerckpt  # noqa: E402
from layerckpt.bench.models import GPT, GPTConfig  # noqa: E402


def main(root: str, kill_at: int, exit_code: int) -> int:
    restart = int(os.environ["LAYERCKPT_RESTART_COUNT"])
    line = {"restart": restart, "preloaded": PRELOADED, "torch_rand": torch.rand(1).item(),
            "random": random.random(), "argv0": sys.argv[0], "name": __name__}
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = os.path.join(root, "ckpt")
    start = 0
    if os.path.isdir(os.path.join(ckpt, "manifests")):
        start = layerckpt.restore(ckpt, model, opt).step
    line["start"] = start
    with open(os.path.join(root, "attempts.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
    if exit_code:
        return exit_code
    with layerckpt.Checkpointer(ckpt, model, opt, layerckpt.Config(full=True)) as ck:
        for step in range(start + 1, 9):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 64, (2, 16), generator=g)
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 2 == 0:
                ck.save(step).wait()
            if restart == 0 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(root, "final.pt"))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    kill = int(args[args.index("--kill-at") + 1]) if "--kill-at" in args else 0
    code = int(args[args.index("--exit") + 1]) if "--exit" in args else 0
    sys.exit(main(args[0], kill, code))
