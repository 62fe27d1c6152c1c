"""What the default Config costs the machine, for comparing two commits run one after the other: GPT-2-mini with
AdamW (645 MB of state), two torch threads, batch 2 x 32 tokens.  Step time: the median and mean wall time of 10
steps without checkpoints, and of 20 steps with a save every 2 (a step's time includes its save() call and any
wait the save's copies cause).  Then 5 saves, each after a step and after the disk's O_DIRECT write of the
state's size into a new file (``DiskLimits.write``): CPU of every thread from save() to every tier done, and
durable; the first of the five is left out of the medians.

    PYTHONPATH=<other checkout>/core python benchmarks/default_before_after.py <name>   # and without PYTHONPATH
"""
import json, os, resource, shutil, statistics, sys, tempfile, time
from dataclasses import asdict
import torch, layerckpt
from torch.nn import functional as F
from layerckpt.bench.models import GPT, GPTConfig
from layerckpt.bench.sharded import SIZES
from layerckpt.bench.cases import DiskLimits
torch.manual_seed(0); torch.set_num_threads(2)
cfg = GPTConfig(**asdict(SIZES["gpt2-mini"]))
model = GPT(cfg); opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
def step():
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward(); opt.step(); opt.zero_grad(set_to_none=True)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
root = tempfile.mkdtemp(dir="/work", prefix="s55-def-")
for _ in range(2): step()
plain = []
for _ in range(10):
    t = time.perf_counter(); step(); plain.append(time.perf_counter() - t)
ck = layerckpt.Checkpointer(os.path.join(root, "ck"), model, opt)
withck, n = [], 0
for i in range(20):
    t = time.perf_counter(); step()
    if i % 2 == 1:
        n += 1; ck.save(n)
    withck.append(time.perf_counter() - t)
ck.wait()
state = sum(t.numel() * t.element_size() for t in list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)])
disk = DiskLimits(os.path.join(root, "limit"), state, 16 << 20, 8)
cpus, durables, limits = [], [], []
for j in range(5):
    step()
    limits.append(disk.write())
    c0 = cpu(); n += 1; p = ck.save(n); p.wait(); ck.wait()
    cpus.append(cpu() - c0); durables.append(p.durable_s)
disk.close(); ck.close(); shutil.rmtree(root, ignore_errors=True)
med = statistics.median
print(json.dumps({"commit": sys.argv[1], "state_MB": round(state / 1e6), "step_plain_s": round(med(plain), 3),
                  "step_with_save_every_2_s": round(med(withck), 3), "step_mean_plain": round(sum(plain) / len(plain), 3),
                  "step_mean_with": round(sum(withck) / len(withck), 3),
                  "cpu_per_save_s": round(med(cpus[1:]), 3), "durable_s": round(med(durables[1:]), 3),
                  "limit_s": round(med(limits[1:]), 3), "durable_over_limit": round(med(durables[1:]) / med(limits[1:]), 2)}))
