"""PEFT (LoRA) models under transformers' Trainer and under Lightning: the frozen base is written once, later saves
write the adapter's tensors and their optimizer state alone, a full-mode resume ends where the uninterrupted run
ends bit for bit, and `layerckpt export --peft` writes the adapter as PEFT's save_pretrained does, which
PeftModel.from_pretrained loads.  Tiny GPT-2s built from their config (no download), a few steps each."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import peft
import transformers  # noqa: F401

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import layerckpt  # noqa: E402
import transformers_layerckpt  # noqa: E402
from layerckpt import store  # noqa: E402
from layerckpt.format._manifest import load_manifest  # noqa: E402
from layerckpt.cli import main  # noqa: E402
from layerckpt.interop import export_peft, peft_extra  # noqa: E402

STEPS, EVERY, STOP = 12, 4, 10
LORA = dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.1)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def lora_model() -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note that GPT-2's Conv1D takes fan_in_fan_out
        return get_peft_model(tiny_gpt2(), LoraConfig(**LORA))


def data(n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


BATCHES = torch.stack([d["input_ids"] for d in data()]).split(4)


def is_lora(name: str) -> bool:
    return ".lora_" in name


def own_files(root: str) -> dict:
    """step -> (the tensor keys its own data file holds, that file's bytes), for every committed composite."""
    out = {}
    for s in store.steps(root):
        m = load_manifest(store.manifest_path(root, s))
        mine = {k for k, e in m.tensors.items() if e.file.startswith(f"step-{s:08d}.")}
        size = sum(os.path.getsize(os.path.join(root, "data", f)) for f in m.files if f.startswith(f"step-{s:08d}."))
        out[s] = (mine, size)
    return out


def check_base_once(root: str, first: int, model: torch.nn.Module, prefix: str = "", later=None) -> None:
    """The composite of ``first`` wrote every tensor; each ``later`` one (default: every other) wrote exactly the
    LoRA tensors and their optimizer state (and the RNG states), and carries the frozen base from ``first``."""
    tied = load_manifest(store.manifest_path(root, first)).aliases  # a tied name is stored under its first name
    names = {prefix + n for n in model.state_dict()} - set(tied)
    lora = {n for n in names if is_lora(n)}
    files = own_files(root)
    assert {f"model/{n}" for n in names} <= files[first][0]
    later = [s for s in files if s != first] if later is None else later
    assert later and first not in later
    for s in later:
        mine = files[s][0]
        weights = {k[len("model/"):] for k in mine if k.startswith("model/")}
        moments = {k[len("optim/"):].rsplit("/", 1)[0] for k in mine if k.startswith("optim/")}
        assert weights == lora and moments == lora, (s, sorted(weights ^ lora), sorted(moments ^ lora))
        assert all(k.startswith(("model/", "optim/", "rng/", "extra/")) for k in mine), sorted(mine)
        m = load_manifest(store.manifest_path(root, s))
        base = {f"model/{n}" for n in names - lora}
        assert {m.tensors[k].file for k in base if k in m.tensors} == {f for f in m.files if f.startswith(
            f"step-{first:08d}.")}, s
    assert all(files[s][1] * 3 < files[first][1] for s in later), {s: files[s][1] for s in files}


def same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def as_written(config: dict) -> dict:
    """An adapter_config.json's dict with the sets PEFT writes as lists in set order sorted (layerckpt sorts them)."""
    return {k: sorted(v) if k in ("target_modules", "exclude_modules") and isinstance(v, list) else v
            for k, v in config.items()}


def one_line_error(capsys, argv, *says) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for s in says:
        assert s in err[0], (s, err[0])
    return err[0]


def check_export(root: str, out: str, prefix: str = "") -> None:
    """``out`` (export --peft of the newest composite of ``root``) is what PEFT's own save_pretrained writes of the
    saved adapter, and PeftModel.from_pretrained loads it with the checkpoint's LoRA tensors, bit for bit."""
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = layerckpt.read_checkpoint(root)
    ref = lora_model()
    ref.save_pretrained(os.path.join(os.path.dirname(out), "peft-own"))
    with open(os.path.join(out, "adapter_config.json")) as a, \
            open(os.path.join(os.path.dirname(out), "peft-own", "adapter_config.json")) as b:
        assert as_written(json.load(a)) == as_written(json.load(b))  # inference_mode, auto_mapping included
    own = load_file(os.path.join(os.path.dirname(out), "peft-own", "adapter_model.safetensors"))
    got = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert got.keys() == own.keys() and len(got) == 8
    loaded = PeftModel.from_pretrained(tiny_gpt2(), out)
    lora = {n: t for n, t in loaded.state_dict().items() if is_lora(n)}
    assert len(lora) == 8
    for n, t in lora.items():
        assert torch.equal(t, saved.model[prefix + n]), n
        assert not torch.equal(t, ref.state_dict()[n]), n  # trained, not as initialised


# ------------------------------------------------------------------ transformers Trainer


class Stop(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == STOP:
            raise KeyboardInterrupt("stopped part-way")


def make(out, attach=None, callbacks=()):
    args = TrainingArguments(str(out), max_steps=STEPS, save_steps=EVERY, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], use_cpu=True, seed=0, logging_steps=1,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=lora_model(), args=args, train_dataset=data(), callbacks=list(callbacks))
    if attach is not None:
        trainer.layerckpt = transformers_layerckpt.attach(trainer, **attach)
    return trainer


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Plain Trainer's uninterrupted run, and an attached one (full mode) stopped at step 10 and resumed."""
    tmp = tmp_path_factory.mktemp("trainer")
    plain = make(tmp / "plain")
    plain.train()
    with pytest.raises(KeyboardInterrupt):
        make(tmp / "lc", attach={"full": True}, callbacks=[Stop()]).train()
    stopped = own_files(str(tmp / "lc" / "layerckpt"))
    resumed = make(tmp / "lc", attach={"full": True})
    resumed.train(resume_from_checkpoint=True)
    return tmp, plain, resumed, stopped


def test_trainer_resume_in_full_mode_is_bit_exact(trainer_runs):
    _, plain, resumed, _ = trainer_runs
    assert resumed.layerckpt.last_restore.step == 8
    same_state(resumed.model.state_dict(), plain.model.state_dict())
    opt, want = resumed.optimizer.state_dict(), plain.optimizer.state_dict()
    assert len(opt["state"]) == len(want["state"]) == 8  # the LoRA tensors alone train
    for i, st in want["state"].items():
        same_state(opt["state"][i], st)


def test_trainer_writes_the_frozen_base_once_then_the_adapter_alone(trainer_runs):
    tmp, _, resumed, stopped = trainer_runs
    root = str(tmp / "lc" / "layerckpt")
    assert list(stopped) == [4, 8] and store.steps(root) == [4, 8, 12]
    check_base_once(root, EVERY, resumed.model, later=[8])
    folder = os.listdir(tmp / "lc" / "checkpoint-8")
    assert "adapter_config.json" in folder and "layerckpt.json" in folder and "adapter_model.safetensors" not in folder


def test_trainer_after_a_resume_in_full_mode_the_base_is_not_written_again(trainer_runs):
    tmp, _, resumed, _ = trainer_runs
    check_base_once(str(tmp / "lc" / "layerckpt"), EVERY, resumed.model, later=[12])


def test_trainer_export_peft_loads_in_peft(trainer_runs, capsys):
    tmp, _, _, _ = trainer_runs
    out = tmp / "adapter"
    assert main(["export", str(tmp / "lc" / "layerckpt"), "--peft", str(out)]) == 0
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    check_export(str(tmp / "lc" / "layerckpt"), str(out))
    one_line_error(capsys, ["export", str(tmp / "lc" / "layerckpt"), "--peft", str(out)],
                   "it exists and is not empty", "name a new or empty directory")
    older = tmp / "adapter-8"
    export_peft(tmp / "lc" / "layerckpt", older, step=8)
    got = load_file(str(older / "adapter_model.safetensors"))
    saved = layerckpt.read_checkpoint(str(tmp / "lc" / "layerckpt"), step=8).model
    assert all(torch.equal(t, saved[k.replace(".weight", ".default.weight")]) for k, t in got.items())


# ------------------------------------------------------------------ errors and a checkpoint without the record


def test_export_peft_errors_are_one_line(tmp_path, capsys):
    plain = tmp_path / "plain"
    with layerckpt.Checkpointer(plain, torch.nn.Linear(4, 2)) as ck:
        ck.save(1).wait()
    one_line_error(capsys, ["export", str(plain), "--peft", str(tmp_path / "a")],
                   "holds no PEFT adapter", "no LoRA tensor")
    model = lora_model()
    bare = tmp_path / "bare"
    with layerckpt.Checkpointer(bare, model) as ck:
        ck.save(1).wait()  # no extra: no record of the adapter's config
    one_line_error(capsys, ["export", str(bare), "--peft", str(tmp_path / "a")],
                   "holds LoRA tensors but no adapter config", "--peft-config PATH")
    one_line_error(capsys, ["export", str(bare), "--peft", str(tmp_path / "a"), "-o", str(tmp_path / "x")],
                   "--peft OUT_DIR is the output: drop -o")
    one_line_error(capsys, ["export", str(bare), "--peft-config", str(tmp_path), "-o", str(tmp_path / "x")],
                   "add --peft OUT_DIR")
    one_line_error(capsys, ["export", str(bare), "--peft", str(tmp_path / "a"), "--peft-config", str(tmp_path)],
                   f"no adapter config at {tmp_path / 'adapter_config.json'}")
    assert not os.path.exists(tmp_path / "a")
    # the config PEFT wrote, given: the LoRA tensors are told by their names
    model.save_pretrained(str(tmp_path / "own"))
    assert main(["export", str(bare), "--peft", str(tmp_path / "a"), "--peft-config", str(tmp_path / "own")]) == 0
    got, own = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("a", "own"))
    assert got.keys() == own.keys() and all(torch.equal(got[k], own[k]) for k in own)
    (tmp_path / "file").write_text("")
    one_line_error(capsys, ["export", str(bare), "--peft", str(tmp_path / "file"), "--peft-config",
                            str(tmp_path / "own")], "exists and is not a directory")


def test_peft_extra_records_what_save_pretrained_writes(tmp_path):
    model = lora_model()
    assert peft_extra(tiny_gpt2()) == {} and peft_extra(torch.nn.Linear(2, 2)) == {}
    rec = peft_extra(model)["peft"]["adapters"]
    model.save_pretrained(str(tmp_path))
    with open(tmp_path / "adapter_config.json") as f:
        assert rec["default"]["config"] == as_written(json.load(f))
    assert sorted(rec["default"]["tensors"]) == sorted(load_file(str(tmp_path / "adapter_model.safetensors")))
    wrapped = torch.nn.ModuleDict({"inner": model})
    assert all(v.startswith("inner.base_model.model.") for v in
               peft_extra(wrapped)["peft"]["adapters"]["default"]["tensors"].values())


# ------------------------------------------------------------------ Lightning


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    """An uninterrupted Lightning run (full mode) and one crashed at step 10 and resumed from "last"."""
    import lightning  # noqa: F401
    from lightning_layerckpt import LayerCheckpoint
    from lit_helpers import Crash, CrashAt, trainer

    tmp = tmp_path_factory.mktemp("lightning")
    Lit = _lit_module()

    def fit(d, crash=None, resume=False):
        torch.manual_seed(7 if not resume else 123)  # a new process starts from other RNG states
        m = Lit()
        cb = LayerCheckpoint(dirpath=str(d), every_n_train_steps=EVERY, save_top_k=-1, full=True)
        t = trainer(STEPS, [cb] + ([CrashAt(crash)] if crash else []), str(tmp))
        if crash:
            with pytest.raises(Crash):
                t.fit(m)
        else:
            t.fit(m, ckpt_path="last" if resume else None)
        return t, m, cb

    ref_t, ref_m, _ = fit(tmp / "ref")
    fit(tmp / "run", crash=STOP)
    t, m, cb = fit(tmp / "run", resume=True)
    return tmp, (ref_t, ref_m), (t, m, cb)


def _lit_module():
    import lightning.pytorch as L

    class LitLora(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = lora_model()

        def training_step(self, batch, batch_idx):
            # the batch depends on the step alone: a run resumed mid-epoch sees the uninterrupted run's data
            ids = BATCHES[int(self.global_step) % len(BATCHES)]
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.arange(1000), batch_size=1)  # only its length matters

    return LitLora


def test_lightning_resume_in_full_mode_is_bit_exact_and_writes_the_base_once(lightning_runs):
    from conftest import assert_same_optimizer_state

    tmp, (ref_t, ref_m), (t, m, cb) = lightning_runs
    assert cb.restored["step"] == 8
    same_state(m.state_dict(), ref_m.state_dict())
    assert_same_optimizer_state(t.optimizers[0].state_dict(), ref_t.optimizers[0].state_dict())
    assert len(t.optimizers[0].state_dict()["state"]) == 8
    check_base_once(str(tmp / "ref"), EVERY, m.model, prefix="model.")  # 8 and 12 write the adapter alone
    check_base_once(str(tmp / "run"), EVERY, m.model, prefix="model.", later=[8])  # before the crash


def test_lightning_export_peft_loads_in_peft(lightning_runs, capsys):
    tmp, _, _ = lightning_runs
    out = tmp / "adapter"
    assert main(["export", str(tmp / "run"), "--peft", str(out)]) == 0
    check_export(str(tmp / "run"), str(out), prefix="model.")
