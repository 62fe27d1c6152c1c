"""A family of small, deterministic training workloads for judging layer-selection rules.

Pure torch: nothing here imports layerckpt.  Every workload gives a model and an
optimizer ready to train (``Workload.make()``), a ``batch(step)`` that depends only
on the step (a seeded ``torch.Generator``, never the global RNG, so a restored run
sees the data the uninterrupted run saw), a loss, and a default run length and
checkpoint cadence.  Models keep layerckpt's default layer grouping meaningful:
blocks live in a ``ModuleList``/``Sequential``, everything else is a named module.

Pre-trained weights are made once and cached as a plain state_dict under
``$LAYERCKPT_CACHE/family`` (default ``~/.cache/layerckpt/family``), keyed by a
hash of the pre-training config, and loaded with ``torch.load(weights_only=True)``.

    from layerckpt.bench.family import WORKLOADS
    w = WORKLOADS["finetune-3e-5"]
    model, opt = w.make()
    for step in range(w.steps):
        loss = w.train_step(model, opt, step)
"""

import functools
import hashlib
import json
import math
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

VERSION = 2  # bump when a pre-training recipe changes: it is part of the cache key


def _gen(*key: Any) -> torch.Generator:
    """A generator seeded by ``key`` alone (stable across processes and Python hash seeds)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Build a module with a fixed seed without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


# ---------------------------------------------------------------------------------------- GPT
VOCAB, SEQ, D, N_LAYER, N_HEAD = 96, 32, 128, 4, 4


class LoRALinear(nn.Linear):
    """A linear layer with a low-rank adapter: ``W x + b + (B A x) * alpha / r``; B starts at zero."""

    def __init__(self, fan_in: int, fan_out: int, rank: int = 0, alpha: float = 8.0):
        super().__init__(fan_in, fan_out)
        self.rank = rank
        if rank:
            self.lora_A = nn.Parameter(torch.randn(rank, fan_in) / math.sqrt(fan_in))
            self.lora_B = nn.Parameter(torch.zeros(fan_out, rank))
            self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale if self.rank else y


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, lora: int = 0):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = LoRALinear(d, 3 * d, lora), LoRALinear(d, d, lora)  # adapters: attention only
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Layers: tok_emb, pos_emb, blocks.0 .. blocks.N-1, ln_f, head."""

    def __init__(self, lora: int = 0):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block(D, N_HEAD, lora) for _ in range(N_LAYER))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln_f(h))


# Sequences follow x[t+1] = (a*x[t] + b) mod VOCAB, except that with probability ``noise`` the next
# token jumps: uniformly (pre-training) or, in the fine-tune task, to a second rule (a2*x + b2) half
# the time, so fine-tuning has something to learn in every block, not only in the head.
PRETRAIN = dict(rule=(5, 3), noise=0.15, second=None)
FINETUNE = dict(rule=(5, 3), noise=0.3, second=(7, 11))


def lm_batch(task: dict, name: str, step: int, batch: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    g = _gen("lm", name, step)
    (a, b), second = task["rule"], task["second"]
    x = [torch.randint(0, VOCAB, (batch,), generator=g)]
    jump = torch.rand(batch, SEQ, generator=g) < task["noise"]
    rand = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    alt = torch.rand(batch, SEQ, generator=g) < 0.5
    for t in range(SEQ):
        nxt, other = (a * x[-1] + b) % VOCAB, rand[:, t]
        if second is not None:
            other = torch.where(alt[:, t], (second[0] * x[-1] + second[1]) % VOCAB, other)
        x.append(torch.where(jump[:, t], other, nxt))
    s = torch.stack(x, 1)
    return s[:, :-1], s[:, 1:]


def lm_loss(model: nn.Module, b) -> torch.Tensor:
    x, y = b
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


# ------------------------------------------------------------------------ sequence classification
# The fine-tuning most users do: a pre-trained encoder, a fresh classification head.  Which of
# RULES generated a sequence (with the pre-training noise of random jumps)?
RULES = [(5, 3), (7, 11), (3, 1), (11, 5)]


class Classifier(GPT):
    """The pre-trained GPT with its LM head replaced by a fresh head on the mean of the final states."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, len(RULES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln_f(h).mean(1))


def cls_batch(step: int, batch: int = 16) -> Tuple[torch.Tensor, torch.Tensor]:
    g = _gen("cls", step)
    y = torch.randint(0, len(RULES), (batch,), generator=g)
    rule = torch.tensor(RULES)[y]
    x = [torch.randint(0, VOCAB, (batch,), generator=g)]
    jump = torch.rand(batch, SEQ, generator=g) < PRETRAIN["noise"]
    rand = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    for t in range(SEQ - 1):
        x.append(torch.where(jump[:, t], rand[:, t], (rule[:, 0] * x[-1] + rule[:, 1]) % VOCAB))
    return torch.stack(x, 1), y


def cls_loss(model: nn.Module, b) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1])


# ---------------------------------------------------------------------------------------- CNN
N_CLASS, IMG = 8, 16


def _parts() -> torch.Tensor:
    """A bank of 12 smooth random 3x8x8 patterns: classes are made of pairs of them."""
    p = torch.randn(12, 3, 4, 4, generator=_gen("parts"))
    return F.interpolate(p, size=(8, 8), mode="bilinear", align_corners=False)


PAIRS = {"pre": [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (0, 6), (3, 9)],
         "fine": [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 0), (1, 7), (2, 8)]}


def img_batch(task: str, step: int, batch: int = 32) -> Tuple[torch.Tensor, torch.Tensor]:
    g, parts = _gen("img", task, step), _parts()
    y = torch.randint(0, N_CLASS, (batch,), generator=g)
    x = 1.2 * torch.randn(batch, 3, IMG, IMG, generator=g)
    pos = torch.randint(0, IMG - 8 + 1, (batch, 2, 2), generator=g)
    for i in range(batch):
        for j, part in enumerate(PAIRS[task][int(y[i])]):
            r, c = int(pos[i, j, 0]), int(pos[i, j, 1])
            x[i, :, r:r + 8, c:c + 8] += parts[part]
    return x.contiguous(memory_format=torch.channels_last), y


class CNN(nn.Module):
    """Layers: features.0 .. features.3 (conv + batch norm), head."""

    def __init__(self):
        super().__init__()
        def stage(i, o, stride):
            return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())
        self.features = nn.Sequential(stage(3, 32, 1), stage(32, 64, 2), stage(64, 64, 1), stage(64, 128, 2))
        self.head = nn.Linear(128, N_CLASS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def img_loss(model: nn.Module, b) -> torch.Tensor:
    return F.cross_entropy(model(b[0]), b[1])


# ---------------------------------------------------------------------------------- embedding
N_ITEMS, E_DIM, BAG = 50_000, 64, 8


class Recommender(nn.Module):
    """A user's history (a bag of item ids) and a candidate item -> click logit.
    Layers: emb (50k x 64, ~98% of the parameters), mlp.0, mlp.2, mlp.4."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(N_ITEMS, E_DIM, mode="mean")
        nn.init.normal_(self.emb.weight, std=0.1)
        self.mlp = nn.Sequential(nn.Linear(2 * E_DIM, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, hist: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        u, v = self.emb(hist), self.emb(item[:, None])
        return self.mlp(torch.cat([u * v, u - v], 1)).squeeze(1)


def _zipf(g: torch.Generator, shape) -> torch.Tensor:
    """Item ids with Zipf-like popularity (id 0 the most popular), as in a frequency-sorted catalogue."""
    u = torch.rand(shape, generator=g)
    return ((N_ITEMS + 1.0) ** u - 1.0).long().clamp_(0, N_ITEMS - 1)  # P(id) ~ 1 / (id + 1)


@functools.lru_cache(maxsize=1)
def _topics() -> torch.Tensor:
    return torch.randint(0, 16, (N_ITEMS,), generator=_gen("topics"))


def rec_batch(step: int, batch: int = 64) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen("rec", step)
    hist, item = _zipf(g, (batch, BAG)), _zipf(g, (batch,))
    topics = _topics()  # a hidden topic per item: clicks are likely when the history shares the candidate's
    like = (topics[hist] == topics[item][:, None]).float().mean(1)
    p = torch.sigmoid(6.0 * like - 1.5)
    return hist, item, (torch.rand(batch, generator=g) < p).float()


def rec_loss(model: nn.Module, b) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(b[0], b[1]), b[2])


# -------------------------------------------------------------------------------- pre-training
def cache_dir() -> str:
    root = os.environ.get("LAYERCKPT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "layerckpt")
    return os.path.join(root, "family")


def pretrained(kind: str) -> Dict[str, torch.Tensor]:
    """The pre-trained state_dict of ``kind`` ("gpt" or "cnn"), trained once and cached on disk."""
    cfg = dict(kind=kind, version=VERSION, steps=300, batch=16 if kind == "gpt" else 64, lr=1e-3, seed=0,
               task=PRETRAIN if kind == "gpt" else PAIRS["pre"], dims=[VOCAB, SEQ, D, N_LAYER, N_HEAD, IMG])
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"{kind}-{key}.pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=True)
    model = _seeded(0, GPT if kind == "gpt" else CNN)
    if kind == "cnn":
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    warm_cos = lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / cfg["steps"]))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm_cos)
    for step in range(cfg["steps"]):
        b = lm_batch(PRETRAIN, "pre", step, cfg["batch"]) if kind == "gpt" else img_batch("pre", step, cfg["batch"])
        (lm_loss if kind == "gpt" else img_loss)(model, b).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: concurrent first runs each write a whole file
    return state


def pretrained_file(kind: str) -> str:
    """The pre-trained weights of ``kind`` as a safetensors file beside the cached state_dict (written once,
    atomically): what a user's fine-tune starts from and names in ``Config(pretrained=...)``."""
    from safetensors.torch import save_file

    state = pretrained(kind)
    key = hashlib.sha256(json.dumps(sorted((k, list(v.shape)) for k, v in state.items())).encode()).hexdigest()[:8]
    path = os.path.join(cache_dir(), f"{kind}-{VERSION}-{key}.safetensors")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        save_file(state, tmp)
        os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]  # the model, pre-trained weights loaded
    optim: Callable[[nn.Module], torch.optim.Optimizer]
    data: Callable[[int], Any]  # batch for a training step
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    steps: int = 200
    every: int = 5  # checkpoint cadence, in steps
    layers: Optional[Callable[[str], str]] = None  # None: layerckpt's default grouping
    note: str = ""
    base: Optional[str] = None  # the pre-trained weights it starts from ("gpt", "cnn": ``pretrained_file``)

    def make(self) -> Tuple[nn.Module, torch.optim.Optimizer]:
        model = self.build()
        return model, self.optim(model)

    def batch(self, step: int) -> Any:
        return self.data(step)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.loss_fn(model, batch)

    def train_step(self, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
        model.train()
        loss = self.loss(model, self.batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def eval_loss(self, model: nn.Module, step: int = 0) -> float:
        """Loss on a held-out batch (its own seed stream, disjoint from training steps)."""
        was = model.training
        model.eval()
        with torch.no_grad():
            out = float(self.loss(model, self.batch(-1 - step)))
        model.train(was)
        return out


def _gpt(pretrain: bool = True, lora: int = 0, frozen: bool = False) -> nn.Module:
    model = _seeded(1, lambda: GPT(lora))
    if pretrain:
        model.load_state_dict(pretrained("gpt"), strict=not lora)
    if frozen or lora:
        for n, p in model.named_parameters():
            p.requires_grad_(("lora_" in n) if lora else n.startswith("head."))
    return model


def _classifier() -> nn.Module:
    model = _seeded(1, Classifier)
    model.load_state_dict({k: v for k, v in pretrained("gpt").items() if not k.startswith("head.")}, strict=False)
    return model


def _cnn() -> nn.Module:
    model = _seeded(1, CNN)
    state = pretrained("cnn")
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("head.")}, strict=False)  # fresh head
    return model.to(memory_format=torch.channels_last)


def _adamw(lr: float, wd: float = 0.01):
    return lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr, weight_decay=wd)


def _lm(name: str):
    return lambda step: lm_batch(FINETUNE, name, step)


WORKLOADS: Dict[str, Workload] = {}
for _lr in ("1e-5", "3e-5", "1e-4"):
    WORKLOADS[f"classify-{_lr}"] = Workload(
        f"classify-{_lr}", _classifier, _adamw(float(_lr)), cls_batch, cls_loss,
        note="pre-trained GPT encoder (4 blocks, d=128) + fresh classification head, AdamW", base="gpt")
for _lr in ("1e-5", "3e-5", "1e-4"):
    WORKLOADS[f"finetune-{_lr}"] = Workload(f"finetune-{_lr}", _gpt, _adamw(float(_lr)), _lm("fine"), lm_loss,
                                            note="pre-trained GPT (4 blocks, d=128), shifted LM task, AdamW",
                                            base="gpt")
WORKLOADS.update({
    "scratch-1e-3": Workload("scratch-1e-3", lambda: _gpt(pretrain=False), _adamw(1e-3), _lm("fine"), lm_loss,
                             note="the same GPT from random init, AdamW 1e-3"),
    "frozen-backbone": Workload("frozen-backbone", lambda: _gpt(frozen=True), _adamw(1e-3), _lm("fine"), lm_loss,
                                note="pre-trained GPT frozen except the head; the optimizer holds only the head",
                                base="gpt"),
    "lora": Workload("lora", lambda: _gpt(lora=4), _adamw(1e-3, 0.0), _lm("fine"), lm_loss,
                     note="frozen pre-trained GPT + rank-4 adapters on qkv/proj of every block (in the block's layer)",
                     base="gpt"),
    "cnn": Workload("cnn", _cnn, _adamw(1e-4), lambda s: img_batch("fine", s), img_loss,
                    note="pre-trained conv net (channels_last, BatchNorm), new class pairs, fresh head, AdamW 1e-4",
                    base="cnn"),
    "embedding": Workload("embedding", lambda: _seeded(2, Recommender),
                          lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), rec_batch, rec_loss,
                          note="50k x 64 EmbeddingBag + MLP, Zipf item ids; dense Adam without weight decay"),
})
