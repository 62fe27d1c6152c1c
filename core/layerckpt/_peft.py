"""PEFT adapters (LoRA): what a save records of them, and a composite's adapter written in PEFT's own format.

A model under ``peft.get_peft_model`` keeps its base frozen (``requires_grad`` off) and trains the adapter's
tensors.  The selection needs nothing more: a layer's frozen parameters form a layer of their own,
``<layer>[frozen]``, written at the first save and afterwards carried while they are unchanged, so later saves
write the adapter's tensors and their optimizer state alone.  What this module adds is the way out: PEFT's
``save_pretrained`` writes, for each adapter, ``adapter_model.safetensors`` (the adapter's tensors under PEFT's
names, the adapter's name left out) and ``adapter_config.json``, and :func:`export_peft` writes both from a
composite, without the model.

For that a save records, under ``extra["peft"]`` (:func:`peft_extra`), each adapter's config as PEFT's
``save_pretrained`` writes it and which state_dict name each of PEFT's tensor names is, as PEFT's own
``get_peft_model_state_dict`` picks them: plain JSON, so an export never unpickles.  The Trainer and Lightning
adapters record it at every save; a plain Checkpointer's save takes ``extra={**extra, **peft_extra(model)}``.
A checkpoint saved without the record exports with a config given (``config=``, ``--peft-config``); its tensors
are then the LoRA tensors, told by their names.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import weakref
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from .format import _store
from .io._backend import checksum_function, make_backend
from .format._codec import decode
from .format._manifest import Manifest, load_manifest, model_key, model_name
from .adapters import replace_durably
from .config import Config
from .errors import CheckpointCorruptError, CheckpointError
from .restore import read_tensors

log = logging.getLogger("layerckpt")

#: where a save's ``extra`` holds the record: ``{"adapters": {name: {"config": {...}, "tensors": {peft key: name}}}}``
EXTRA_KEY = "peft"
WEIGHTS = "adapter_model.safetensors"  # peft.utils.SAFETENSORS_WEIGHTS_NAME
CONFIG = "adapter_config.json"  # peft.utils.CONFIG_NAME
#: a LoRA tensor's state_dict name: ``<module>.lora_A.<adapter>.weight``, ``<module>.lora_embedding_A.<adapter>``, ...
_LORA = re.compile(r"\.lora_[A-Za-z_]+\.(?P<adapter>[^.]+)(?:\.[^.]+)?$")
_BASE = "base_model.model."  # where PEFT's names of a LoRA model's tensors start

PathLike = Union[str, "os.PathLike[str]"]
Adapters = Dict[str, Tuple[Dict[str, Any], Dict[str, str]]]  # name -> (config, {PEFT's key: state_dict name})


# ------------------------------------------------------------------ save: the record

def peft_extra(model: torch.nn.Module) -> Dict[str, Any]:
    """What a save of ``model`` records of its PEFT adapters, for ``extra``: ``{"peft": {...}}`` when ``model`` is
    or holds a ``peft.PeftModel`` (the first one, by ``named_modules``), else ``{}``.  Cheap where peft was never
    imported.  An adapter PEFT's own selection of tensors cannot be mapped back to the model's state_dict names
    (prompt learning, tensors gathered from shards) is left out of the record, with a warning: the save goes on."""
    if "peft" not in sys.modules:  # a PeftModel exists only where peft was imported
        return {}
    from peft import PeftModel

    found = next(((p, m) for p, m in model.named_modules() if isinstance(m, PeftModel)), None)
    if found is None:
        return {}
    prefix, pm = found
    try:
        return {EXTRA_KEY: {"adapters": _record(pm, prefix + "." if prefix else "")}}
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        log.warning("layerckpt: this save records no PEFT adapter (layerckpt export --peft will need --peft-config): "
                    "%s", e)
        return {}


def _record(pm: Any, prefix: str) -> Dict[str, Any]:
    return {adapter: {"config": _config_json(pm, cfg), "tensors": {k: prefix + n for k, n in keys.items()}}
            for adapter, cfg in pm.peft_config.items() for keys in [_keys(pm)[adapter]]}


#: PeftModel -> (its adapters' configs by identity, PEFT's key -> state_dict name of each adapter): PEFT's own
#: selection walks the model and its state_dict (8 ms a save on GPT-2 small), and names change only with them
_KEYS: "weakref.WeakKeyDictionary[Any, Tuple[tuple, Dict[str, Dict[str, str]]]]" = weakref.WeakKeyDictionary()


def _keys(pm: Any) -> Dict[str, Dict[str, str]]:
    from peft import get_peft_model_state_dict

    sig = tuple((adapter, id(cfg)) for adapter, cfg in pm.peft_config.items())
    held = _KEYS.get(pm)
    if held is not None and held[0] == sig:
        return held[1]
    sd = pm.state_dict()
    names = {id(t): k for k, t in sd.items()}
    out = {}
    for adapter in pm.peft_config:
        # the embedding tables PEFT may add by its "auto" rule are the frozen base's own: not the adapter's
        chosen = get_peft_model_state_dict(pm, state_dict=sd, adapter_name=adapter, save_embedding_layers=False)
        missing = sorted(k for k, t in chosen.items() if id(t) not in names)
        if missing:
            raise ValueError(f"PEFT's tensor {missing[0]} of adapter {adapter!r} is not one of the model's "
                             f"state_dict tensors")
        out[adapter] = {k: names[id(t)] for k, t in chosen.items()}
    _KEYS[pm] = (sig, out)
    return out


def _config_json(pm: Any, cfg: Any) -> Dict[str, Any]:
    """The adapter's config as ``PeftModel.save_pretrained`` writes it: sets as lists, the base model's name
    filled in, ``inference_mode`` on, ``auto_mapping`` for a model without a task type; plain JSON."""
    d = {k: _listed(v) for k, v in cfg.to_dict().items()}
    base = pm.get_base_model()
    if d.get("base_model_name_or_path") is None:
        d["base_model_name_or_path"] = getattr(base, "name_or_path", None) or None
    d["inference_mode"] = True
    if d.get("task_type") is None:
        d["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    return json.loads(json.dumps(d, allow_nan=False))  # refuses what JSON cannot hold, before anything is staged


def _listed(v: Any) -> Any:
    if not isinstance(v, (set, frozenset)):
        return v
    try:
        return sorted(v)
    except TypeError:
        return list(v)


# ------------------------------------------------------------------ export

def export_peft(path: PathLike, out_dir: PathLike, step: Optional[int] = None,
                config: Union[PathLike, Mapping[str, Any], None] = None) -> str:
    """Write the PEFT adapter(s) of the checkpoint at ``path`` (a store or one of its manifests; the newest, or
    that of ``step``) into ``out_dir``, a new or empty directory, as ``PeftModel.save_pretrained`` lays them out:
    ``adapter_model.safetensors`` and ``adapter_config.json``, the adapter ``default`` in ``out_dir`` and any
    other in ``out_dir/<name>``.  ``PeftModel.from_pretrained(base_model, out_dir)`` loads it.  The tensors are
    the checkpoint's, bit for bit (checksums verified); the directory appears whole (written aside, fsynced,
    renamed).  ``config``: an ``adapter_config.json`` (or a folder holding one) or its dict, for a checkpoint saved
    without the record (see :func:`peft_extra`) or to replace a recorded one.  Returns ``out_dir``."""
    root, at = _store.locate(path)
    if at is not None and step not in (None, at):
        raise CheckpointError(f"{path} is the checkpoint of step {at}, but step {step} was asked for")
    mpath = _store.resolve(root, at if at is not None else step)
    m = load_manifest(mpath)
    out = _fresh_dir(out_dir)
    adapters = find_adapters(m, mpath, _given_config(config))
    tensors = _read(root, m, mpath, sorted({n for _, keys in adapters.values() for n in keys.values()}))
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{os.getpid()}.tmp")
    try:
        _write(tmp, adapters, tensors)
        if os.path.isdir(out):
            os.rmdir(out)  # empty: checked above
        replace_durably(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def find_adapters(m: Manifest, mpath: str, config: Optional[Dict[str, Any]] = None) -> Adapters:
    """Each adapter of the composite ``m``: its config and which state_dict name each of PEFT's keys is, from the
    save's record, else (``config`` given) from the LoRA tensors' names; a one-line error naming what is missing."""
    recorded = _recorded(m, mpath, config is None)
    if recorded:
        if config is not None:
            if len(recorded) > 1:
                raise CheckpointError(f"{mpath} records the configs of the adapters {', '.join(sorted(recorded))}; "
                                      f"one config given cannot replace them all: drop it")
            (name, (_, keys)), = recorded.items()
            return {name: (config, keys)}
        return recorded
    lora = _lora_names(m)
    if not lora:
        raise CheckpointError(f"{mpath} holds no PEFT adapter: no record of one and no LoRA tensor "
                              f"('<module>.lora_A.<adapter>.weight'); export --peft writes a LoRA adapter, "
                              f"-o FILE the whole model")
    if config is None:
        raise CheckpointError(f"{mpath} holds LoRA tensors but no adapter config: it was saved without the PEFT "
                              f"record (the Trainer and Lightning adapters write it; a Checkpointer's save takes "
                              f"extra=layerckpt.interop.peft_extra(model)); give the adapter_config.json: "
                              f"--peft-config PATH (export_peft(config=PATH))")
    return {_only_adapter(lora, mpath): (config, _by_name(lora, config, mpath))}


def _recorded(m: Manifest, mpath: str, strict: bool) -> Adapters:
    """The save's record of its adapters (``{}`` where there is none), checked before anything is read.  A
    malformed one is an error where it is all there is (``strict``), else passed over for the config given."""
    raw = m.extra.get(EXTRA_KEY) if isinstance(m.extra, dict) else None
    if raw is None:
        return {}
    try:
        rec = decode(raw, {})
    except (KeyError, TypeError, ValueError):
        rec = None
    adapters = rec.get("adapters") if isinstance(rec, dict) else None
    out: Adapters = {}
    for name, a in (adapters.items() if isinstance(adapters, dict) else ()):
        cfg, keys = (a.get("config"), a.get("tensors")) if isinstance(a, dict) else (None, None)
        if not (_safe_name(name) and isinstance(cfg, dict) and isinstance(keys, dict) and keys
                and all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items())):
            out = {}
            break
        out[name] = (cfg, keys)
    if not out and strict:
        raise CheckpointCorruptError(f"manifest {mpath}: its PEFT record (extra[{EXTRA_KEY!r}]) is malformed; "
                                     f"give the adapter_config.json: --peft-config PATH (the LoRA tensors are then "
                                     f"found by their names)", path=mpath)
    return out


def _safe_name(name: Any) -> bool:
    """Whether an adapter's name can name its folder (PEFT writes an adapter other than ``default`` there)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name \
        and "\0" not in name


def _lora_names(m: Manifest) -> Dict[str, str]:
    """Each LoRA tensor's state_dict name in ``m`` -> its adapter's name."""
    out = {}
    for name in [*(model_name(k) for k in m.logical_keys()), *m.aliases]:
        hit = _LORA.search(name) if name else None
        if hit:
            out[name] = hit.group("adapter")
    return out


def _only_adapter(lora: Dict[str, str], mpath: str) -> str:
    names = sorted(set(lora.values()))
    if len(names) > 1:
        raise CheckpointError(f"{mpath} holds the LoRA tensors of several adapters ({', '.join(names)}) and no record "
                              f"of which config is whose; save with the PEFT record to export them")
    if not _safe_name(names[0]):
        raise CheckpointError(f"{mpath}: the LoRA tensors' adapter name {names[0]!r} cannot name a folder")
    return names[0]


def _by_name(lora: Dict[str, str], config: Dict[str, Any], mpath: str) -> Dict[str, str]:
    """PEFT's key of each LoRA tensor, by the rule of ``get_peft_model_state_dict`` for LoRA without extra
    tensors: from ``base_model.model.`` on, the adapter's name left out."""
    extra = [f for f, off in (("bias", "none"), ("modules_to_save", None), ("trainable_token_indices", None))
             if config.get(f, off) not in (off, [], {})]
    if config.get("peft_type") != "LORA" or extra:
        what = f"peft_type {config.get('peft_type')!r}" if config.get("peft_type") != "LORA" else ", ".join(
            f"{f}={config[f]!r}" for f in extra)
        raise CheckpointError(f"{mpath} was saved without the PEFT record, and with {what} the adapter's tensors "
                              f"cannot be told by their names; save with the record (layerckpt.interop.peft_extra)")
    out = {}
    for name, adapter in lora.items():
        at = name.find(_BASE)
        if at < 0:
            raise CheckpointError(f"{mpath}: the LoRA tensor {name} is not under a PeftModel ({_BASE}...); save "
                                  f"with the PEFT record (layerckpt.interop.peft_extra) to export it")
        key = name[at:]
        if key.endswith(f"lora_magnitude_vector.{adapter}.weight"):
            key = key[: -len(".weight")]  # DoRA's magnitude, as PEFT names it
        out[_without_adapter(key, adapter)] = name
    return out


def _without_adapter(key: str, adapter: str) -> str:
    """``peft.tuners.tuners_utils._remove_adapter_name_from_state_dict_key``."""
    if key.endswith("." + adapter):
        return key[: -len(adapter) - 1]
    head, _, suffix = key.rpartition(".")
    return f"{head[: -len(adapter) - 1] if head.endswith('.' + adapter) else head}.{suffix}"


def _given_config(config: Union[PathLike, Mapping[str, Any], None]) -> Optional[Dict[str, Any]]:
    if config is None:
        return None
    if isinstance(config, Mapping):
        d: Any = dict(config)
        where = "config"
    else:
        where = os.fspath(config)
        if os.path.isdir(where):
            where = os.path.join(where, CONFIG)
        try:
            with open(where, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"no adapter config at {where}: give an adapter_config.json or a folder holding "
                                  f"one") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read the adapter config {where}: {e}") from None
    if not isinstance(d, dict) or not isinstance(d.get("peft_type"), str):
        raise CheckpointError(f"{where} is not a PEFT adapter config: it has no 'peft_type' (the adapter_config.json "
                              f"PeftModel.save_pretrained writes)")
    return d


def _read(root: str, m: Manifest, mpath: str, names: list) -> Dict[str, torch.Tensor]:
    """The named model tensors of ``m`` (a tied name read as the tensor it is tied to), checksums verified."""
    keys = {}
    for n in names:
        key = model_key(m.aliases.get(n, n))
        if m.describe(key) is None:
            raise CheckpointCorruptError(f"manifest {mpath}: its PEFT record names the tensor {n}, which the "
                                         f"checkpoint does not hold", path=mpath)
        keys[n] = key
    cfg = Config()
    backend = make_backend(cfg.backend, cfg.queue_depth)
    try:
        got = read_tensors(root, m, mpath, sorted(set(keys.values())), backend, checksum_function(m.checksum), cfg)[0]
    finally:
        backend.close()
    return {n: got[k] for n, k in keys.items()}


def _write(tmp: str, adapters: Adapters, tensors: Dict[str, torch.Tensor]) -> None:
    import shutil

    from safetensors.torch import save_file

    from .store import create_file

    shutil.rmtree(tmp, ignore_errors=True)  # left by an export of an earlier process of this pid
    os.mkdir(tmp)
    for name, (cfg, keys) in sorted(adapters.items()):
        d = tmp if name == "default" else os.path.join(tmp, name)  # as PeftModel.save_pretrained places them
        os.makedirs(d, exist_ok=True)
        out, seen = {}, set()
        for k, n in sorted(keys.items()):  # a tensor under two keys is written twice: safetensors shares none
            t = tensors[n]
            out[k] = t.clone() if id(t) in seen else t
            seen.add(id(t))
        save_file(out, os.path.join(d, WEIGHTS), metadata={"format": "pt"})
        with create_file(os.path.join(d, CONFIG), "w") as f:
            f.write(json.dumps(cfg, indent=2, sort_keys=True))


def _fresh_dir(out_dir: PathLike) -> str:
    out = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise CheckpointError(f"cannot write the adapter into {out}: the directory {parent} does not exist; create "
                              f"it first")
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointError(f"cannot write the adapter into {out}: it exists and is not a directory; name a new "
                              f"directory")
    if os.path.isdir(out) and os.listdir(out):
        raise CheckpointError(f"cannot write the adapter into {out}: it exists and is not empty; name a new or "
                              f"empty directory")
    return out
