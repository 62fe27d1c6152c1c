"""Command line: layerckpt inspect | verify | export | plot | bench | launch.

Exit codes: 0 done (verify: every checkpoint verified); 1 verify found a damaged checkpoint or file;
2 any other error (nothing there, bad arguments, an unreadable remote): one line on stderr that says what is
wrong and how to fix it, never a traceback (LAYERCKPT_TRACEBACK=1 prints one before the line); 130 interrupted."""
from __future__ import annotations

import argparse
import os
import sys
from typing import AbstractSet, Dict, List, Optional

import torch

from . import _progress
from .format import _store
from .format import _sign
from .io._backend import checksum_function, make_backend
from ._cli_run import Parser, figure_path, run
from .read._fetch import unreadable_in
from .format._manifest import MODEL, OPTIM, Manifest, load_manifest, model_name, piece_base
from .format._store import PART, read_part
from .config import Config
from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .restore import check_state, read_tensors


#: bytes (as stored) read per call while a progress bar runs: the bar moves at least this often
_BATCH_BYTES = 256 << 20


def _read_tensors(root: str, m: Manifest, keys: List[str], mpath: str = "manifest",
                  bar: Optional[_progress.Bar] = None) -> Dict[str, torch.Tensor]:
    """Read the named tensors of manifest ``m`` (checksums verified), in batches that move ``bar`` by the
    bytes each takes in its file."""
    cfg = Config()
    backend = make_backend(cfg.backend, cfg.queue_depth)
    out: Dict[str, torch.Tensor] = {}
    try:
        for batch in _batches(m, keys):
            out.update(read_tensors(root, m, mpath, batch, backend, checksum_function(m.checksum), cfg)[0])
            if bar is not None:
                bar.update(sum(_stored(m.tensors[k]) for k in batch if k in m.tensors))
        return out
    finally:
        backend.close()


def _batches(m: Manifest, keys: List[str]) -> List[List[str]]:
    """``keys`` in order, cut where a batch reaches ``_BATCH_BYTES`` as stored."""
    out: List[List[str]] = [[]]
    size = 0
    for k in keys:
        if out[-1] and size >= _BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(k)
        e = m.tensors.get(k)
        size += _stored(e) if e is not None else 0
    return out


def _stored_total(m: Manifest, keys: Optional[List[str]] = None) -> int:
    return sum(_stored(m.tensors[k]) for k in (m.tensors if keys is None else keys) if k in m.tensors)


def _locate(args):
    """(checkpoint directory, manifest path) from a directory or a manifest path, and --step."""
    root, step = _store.locate(args.dir)
    if step is not None and getattr(args, "step", None) not in (None, step):
        raise CheckpointError(f"{args.dir} is the checkpoint of step {step}, but --step {args.step} was asked for")
    return root, _store.resolve(root, step if step is not None else getattr(args, "step", None))


def cmd_inspect(args) -> int:
    root, path = _locate(args)
    m = load_manifest(path)
    nbytes = {k: e.nbytes for k, e in m.tensors.items()}
    named = f" ({m.name})" if m.name else ""
    print(f"{path}{named}: step {m.step}, world size {m.world_size}, {len(m.files)} file(s), "
          f"{sum(nbytes.values()) / 1e6:.1f} MB in {len(m.tensors)} tensors")
    try:
        part = read_part(root)
    except CheckpointError as e:
        print(f"node part: {PART} is damaged ({e})")
        part = None
    if part is not None:
        print(_part_line(part))
    if m.pretrained:
        held = sum(e.nbytes for e in m.pretrained.values())
        print(f"held by reference to the pretrained weights the training started from (in no file: a restore takes "
              f"them from the model, or from Config.pretrained): {held / 1e6:.1f} MB in {len(m.pretrained)} tensors")
        nbytes.update({k: e.nbytes for k, e in m.pretrained.items()})
    lag = ""
    if m.loss_increase is not None:
        lag = f"; estimated fidelity cost {m.cost:.3g} (+{m.loss_increase:.3%} of the training loss {m.loss:.4g})"
    elif m.lag is not None:
        lag = f"; estimated fidelity cost {m.cost:.3g} ({m.lag:.2f} checkpoint intervals of progress)"
    behind = m.steps_behind()
    stored = {k: _stored(e) for k, e in m.tensors.items()}
    print(f"composite: layers trail step {m.step} by up to {max(behind.values(), default=0)} steps{lag}")
    print(f"{'layer':<32}{'step':>10}{'behind':>8}{'age':>5}{'MB':>10}{'stored':>10}{'cost':>10}  reason")
    for name, e in sorted(m.layers.items()):
        mb = sum(nbytes.get(k, 0) for k in e.tensors) / 1e6
        st = sum(stored.get(k, 0) for k in e.tensors) / 1e6
        drift = f"  drift {e.drift:.4g}" if e.drift is not None else ""
        cost = f"{e.cost:.3g}" if e.cost is not None else "-"
        print(f"{name:<32}{e.step:>10}{behind[name]:>8}{e.age:>5}{mb:>10.2f}{st:>10.2f}{cost:>10}  {e.reason}{drift}")
    print("by kind (MB raw -> MB stored, the version each tensor's newest file holds; a delta's reference not "
          "counted):")
    for kind, (raw, st) in sorted(_by_kind(m, stored).items()):
        print(f"  {kind:<24}{raw / 1e6:>10.2f} -> {st / 1e6:>8.2f}  ({raw / max(st, 1):.2f}x)")
    _print_coding(m)
    _print_lossy(m)
    for key, b in (m.blocks or {}).items():
        print(f"row blocks: {key} {tuple(b.shape)} {b.dtype} in {len(b.rows)} blocks of up to "
              f"{max(z - a for a, z in b.rows)} rows")
    for key, b in (m.boxes or {}).items():
        print(f"boxes: {key} {tuple(b.shape)} {b.dtype} in {len(b.boxes)} boxes")
    committed = [s for s, _ in _store.list_manifests(root)]
    print(f"committed steps: {committed}")
    return 0


def _print_coding(m: Manifest) -> None:
    """What ``Config(encoding='auto')`` decided for each kind of tensor this save wrote, and why."""
    for fname, kinds in sorted((m.coding or {}).items()):
        if not isinstance(kinds, dict):
            continue
        print(f"encoding of {fname} (Config.encoding 'auto': a kind is encoded only where the sink time its saved "
              f"bytes take exceeds the CPU it costs):")
        for k, r in sorted(kinds.items()):
            if not isinstance(r, dict):
                continue
            n, b = r.get("tensors"), r.get("bytes")
            size = f"{n} tensors, {b / 1e6:.2f} MB" if isinstance(n, int) and isinstance(b, (int, float)) else ""
            print(f"  {str(k):<24}{str(r.get('mode')):<10}{size}: {r.get('why')}")


def _print_lossy(m: Manifest) -> None:
    """The tensors stored with bounded loss (``Config(encoding='lossy')``), and the error each was restored with."""
    coded = [(k, e.enc["lossy"]) for k, e in sorted(m.tensors.items()) if e.enc and e.enc.get("lossy")]
    if not coded:
        return
    print("bounded loss (Config.encoding 'lossy'): the error each tensor restores with; a weight's in steps of "
          "training (RMS error over one step's RMS move), a moment's relative to its RMS value:")
    for k, r in coded:
        scale = r.get("move") if r.get("code") == "qdelta" else r.get("rms")
        rel = r["rms_err"] / scale if scale else 0.0
        what = f"{rel:.3g} steps" if r.get("code") == "qdelta" else f"{rel:.3%} of its RMS"
        print(f"  {k:<40}{r.get('code'):<8}RMS error {r['rms_err']:.3g} ({what}), largest {r['max_err']:.3g}")


def _stored(e) -> int:
    """Bytes a tensor's entry takes in its own file (encoded: its blocks; else raw)."""
    return sum(b[1] for b in e.enc["blocks"]) if e.enc is not None else e.nbytes


def _by_kind(m: Manifest, stored: Dict[str, int]) -> Dict[str, tuple]:
    """Tensor kind (weights, each optimizer state key, other) -> (raw bytes, stored bytes)."""
    out: Dict[str, list] = {}
    for k, e in m.tensors.items():
        base = piece_base(k)[0]
        if base.startswith(MODEL):
            kind = "weights"
        elif base.startswith(OPTIM) and base.count("/") >= 2:
            kind = "optimizer " + base.rsplit("/", 1)[1]
        else:
            kind = "other"
        acc = out.setdefault(kind, [0, 0])
        acc[0] += e.nbytes
        acc[1] += stored[k]
    return {k: tuple(v) for k, v in out.items()}


def cmd_verify(args) -> int:
    root, _ = _store.locate(args.dir)  # a missing directory, or one that is no checkpoint, is an error
    good, bad = _store.read_all(root)
    unreadable = unreadable_in(root)  # a URL's manifests its local copy could not hold (a FIFO, too big)
    if not good and not bad and not unreadable:
        raise CheckpointNotFoundError(f"no committed checkpoint in {root}: nothing to verify")
    damaged_manifests = {**{n: _damage(root, n) for n in bad}, **unreadable}
    failures = [f"{n}: damaged manifest: {why}" for n, why in sorted(damaged_manifests.items())]
    try:
        part = read_part(root)
    except CheckpointError as e:  # a damaged record: verified as a whole store, its other nodes' files missing
        failures.append(f"{PART}: {e}")
        part = None
    if part is not None:
        print(_part_line(part))
    plans = {name: _plan(root, m, part) for name, m in good.items()}
    damaged: set = set()
    shown = _progress.wanted(getattr(args, "quiet", False))
    with _progress.Bar(sum(_stored_total(m, plans[n][0]) for n, m in good.items()), "verify", shown) as bar:
        checked = sum(_verify_one(root, name, m, bar, failures, damaged, *plans[name])
                      for name, m in sorted(good.items()))
    for f in failures:
        print(f"FAIL {f}")
    for line in _dependents(good, damaged):
        print(line)
    if part is not None:
        print(_elsewhere_line(part, good, {n: p[1] for n, p in plans.items()}))
    held = "" if part is None else f" (of node {part['node']}'s part: every file held here)"
    print(f"{checked} of {len(good) + len(damaged_manifests)} checkpoint(s) verified{held}"
          + ("" if not failures else f", {len(failures)} failed"))
    return 1 if failures else 0


def _others(part: dict) -> List[str]:
    """The other nodes of a node's part."""
    return [str(n) for n in part.get("nodes", []) if n != part["node"]]


def _part_line(part: dict) -> str:
    world = part.get("world")
    of = f" of {world}" if isinstance(world, int) else ""
    others = _others(part)
    where = f"; the other nodes' files are on {', '.join(others)}" if others else ""
    return f"node part: node {part['node']}'s directory (ranks {part['ranks']}{of}){where}"


def _plan(root: str, m: Manifest, part: Optional[dict]) -> tuple:
    """(the tensor keys of ``m`` to read, the data files of ``m`` that are on other nodes): in a node's part
    (``part.json``), a file of another node's ranks that is not here is that node's to hold; every other file,
    this node's own and any other present, is read.  Without a part: every key, nothing elsewhere."""
    from .tiers._tiers import needs_ref

    if part is None:
        return list(m.tensors), set()
    mine = set(part["ranks"])
    away = set()
    for fname, fe in m.files.items():
        if fe.rank in mine:
            continue
        try:
            path = _store.safe_join(root, _store.DATA_DIR, fname, f"manifest of step {m.step}")
        except CheckpointError:
            continue  # a name that is no file's: the read refuses it
        if not os.path.lexists(path):
            away.add(fname)
    keys = [k for k, t in m.tensors.items()
            if t.file not in away and not (needs_ref(t) and t.enc["ref"].get("file") in away)]
    return keys, away


def _elsewhere_line(part: dict, good: Dict[str, Manifest], away: Dict[str, set]) -> str:
    files = {f for fs in away.values() for f in fs}
    ranks = sorted({good[n].files[f].rank for n, fs in away.items() for f in fs})
    others = ", ".join(_others(part)) or "the other nodes"
    if not files:
        return f"elsewhere: none: every file of the {len(good)} checkpoint(s) is here"
    return (f"elsewhere: {len(files)} file(s) of ranks {ranks} are on the other nodes ({others}), not in this "
            f"node's directory; verify each node's directory there")


def cmd_shm(args) -> int:
    from .tiers import _shm
    from .tiers._memtier import _base

    found = _shm.scan()
    if not found:
        print(f"no memory tier in {_base()}")
        return 0
    for f in found:
        print(f"{f.state:8s} {f.nbytes / 1e6:10.1f} MB  {f.path}  ({f.why})")
    orphans = [f for f in found if f.state == _shm.ORPHAN]
    if args.prune:
        gone = _shm.prune(found)
        print(f"removed {len(gone)} orphan(s), {sum(f.nbytes for f in gone) / 1e6:.1f} MB")
        return 0 if len(gone) == len(orphans) else 1
    if orphans:
        print(f"{len(orphans)} orphan(s), {sum(f.nbytes for f in orphans) / 1e6:.1f} MB: "
              f"`layerckpt shm --prune` removes them")
    return 0


def _verify_one(root: str, name: str, m: Manifest, bar: _progress.Bar, failures: List[str], damaged: set,
                keys: Optional[List[str]] = None, away: AbstractSet[str] = frozenset()) -> bool:
    """Read every tensor of one committed checkpoint (``keys``: those a node's part holds, ``away``: the files
    on other nodes), decode what a restore decodes besides them (RNG states, extra) and check what a restore checks
    besides (the pretrained references' seals, the optimizer state against its parameters); a failure goes to
    ``failures`` (and its data file, when named, to ``damaged``)."""
    try:
        where = os.path.join(root, _store.MANIFEST_DIR, name)
        key = _sign.key_of()
        if key is not None:  # a signed store's (with $LAYERCKPT_SIGN_KEY): as a restore with the key checks it
            _sign.load_signed(root, where, key)
        if m.pretrained:  # no bytes to read, but the seals a restore checks before it reads anything
            from .read._pretrained import check_seals

            check_seals(m, list(m.pretrained), checksum_function(m.checksum), where)
        tensors = _read_tensors(root, m, list(m.tensors) if keys is None else keys, name, bar)
        if away:
            _check_part_state(m, tensors, where, away)
        else:
            check_state(m, tensors, where)
        _check_optimizer_state(m, where)  # after the reads: where the data is damaged too, that is what is named
        return True
    except CheckpointError as e:
        failures.append(f"{name}: {e}")
        if getattr(e, "path", None) and os.path.dirname(e.path).endswith(_store.DATA_DIR):
            damaged.add(os.path.basename(e.path))
    except _UNREADABLE as e:  # whatever else a damaged store provokes is a failure of that checkpoint too
        failures.append(f"{name}: cannot be read ({type(e).__name__}: {e})")
    return False


def _check_optimizer_state(m: Manifest, where: str) -> None:
    """What a restore into the model and optimizer that saved ``m`` checks of the optimizer state before it reads
    anything (``restore._state_problem``, ``restore._optimizer_keys``), with each parameter as the manifest itself
    records it (its model entry's dtype and shape): every state entry of the parameter's dtype and shape (or a
    scalar where one belongs), and every parameter with state listed in a param group."""
    from .format._layout import CODES
    from .format._manifest import model_key
    from .restore import _PARAM_SHAPED, _malformed, _state_problem

    saved = m.optimizer
    if not saved:
        return
    with _malformed(where, "the optimizer state"):
        mine = saved.get("class")
        known = mine is not None and mine in {f"{c.__module__}.{c.__qualname__}" for c in _PARAM_SHAPED}
        grouped = {n for g in saved["param_groups"] for n in g["params"]}
        bad = []
        for name, st in saved["state"].items():
            if name not in grouped:
                bad.append(f"optimizer.state[{name}]: the state of a parameter no param group lists")
                continue
            d = m.describe(model_key(m.aliases.get(name, name)))
            if d is None or d[0] not in CODES or not isinstance(st, dict):
                continue  # a parameter the model's entries do not hold: a restore matches it with the model
            p = torch.empty(d[1], dtype=CODES[d[0]], device="meta")
            for key, v in st.items():
                problem = _state_problem(key, v, p, m, known)
                if problem:
                    bad.append(f"optimizer.state[{name}][{key!r}]: {problem}")
    if bad:
        raise CheckpointCorruptError(
            f"manifest {where}: the optimizer state does not match the parameters it is the state of, as the "
            f"manifest records them (a restore into the model and optimizer that saved it refuses it): "
            f"{'; '.join(bad)}; the manifest was edited or damaged: restore another step", path=where)


def _check_part_state(m: Manifest, tensors: Dict[str, torch.Tensor], where: str, away: AbstractSet[str]) -> None:
    """``check_state`` of a node's part: the structure decodes with the tensors on other nodes stood in for;
    each rank's RNG states are checked where their tensors are here (the other nodes' are theirs to check)."""
    from .restore import _Described, _State, _every_rng
    from .write._gather import rng_values

    _State.decoded(None, None, m, _Described(m, tensors), None, where)
    for rank_rng in _every_rng(m):
        absent = [k for k in _refs(rank_rng) if k not in tensors]
        if absent and all(k in m.tensors and m.tensors[k].file in away for k in absent):
            continue
        rng_values(rank_rng, tensors, where)


def _refs(obj) -> List[str]:
    """The tensor keys an encoded value refers to."""
    out, stack = [], [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, list):
            stack.extend(o)
        elif isinstance(o, dict):
            tag, ref = next(iter(o.items())) if len(o) == 1 else (None, None)
            if tag in ("__tensor__", "__ndarray__") and isinstance(ref, str):
                out.append(ref)
            else:
                stack.extend(o.values())
    return out


def _dependents(good: Dict[str, Manifest], damaged: set) -> List[str]:
    """For each damaged data file: every composite that needs it (as its own data or as the reference its
    deltas are encoded against)."""
    from .tiers._tiers import needs_ref

    def needed(m: Manifest) -> set:
        return {t.file for t in m.tensors.values()} | {t.enc["ref"]["file"] for t in m.tensors.values()
                                                       if needs_ref(t)}

    out = []
    for f in sorted(damaged):
        needs = [n for n, m in sorted(good.items()) if f in needed(m)]
        out.append(f"DAMAGED {f}: needed by {len(needs)} checkpoint(s): {', '.join(needs)}")
    return out


#: what verify counts as a failed checkpoint beside the library's own errors: a damaged store must never make
#: verify stop with a traceback, or pass
_UNREADABLE = (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RuntimeError,
               RecursionError, MemoryError, OSError)


def _damage(root: str, name: str) -> str:
    """What is wrong with a manifest ``read_all`` could not read."""
    try:
        load_manifest(os.path.join(root, _store.MANIFEST_DIR, name))
    except CheckpointError as e:
        return str(e)
    return "unreadable"


#: export's output kinds (args attribute, flag); none: a safetensors file
_EXPORTS = (("dcp", "--dcp"), ("peft", "--peft"), ("lightning", "--lightning"), ("accelerate", "--accelerate"),
            ("transformers", "--transformers"))


def _check_export(args) -> None:
    """Refuse, before any work, two output kinds at once, --step where DIR is one step's folder, and an -o that
    exists as a directory or special file where a file is written."""
    kinds = [flag for dest, flag in _EXPORTS if getattr(args, dest) not in (None, False)]
    if len(kinds) > 1:
        raise CheckpointError(f"{' and '.join(kinds)} are different outputs: give one of them")
    for dest, flag in (("dcp", "--dcp"), ("peft", "--peft")):
        if getattr(args, dest) is not None and args.output is not None:
            raise CheckpointError(f"{flag} OUT_DIR is the output: drop -o")
    if args.peft_config is not None and args.peft is None:
        raise CheckpointError("--peft-config is the config of the adapter --peft OUT_DIR writes: add --peft OUT_DIR")
    if args.pretrained is not None and args.peft is not None:
        raise CheckpointError("--pretrained does not apply to --peft: an adapter trains, so no tensor of it is held "
                              "by reference to the pretrained weights; drop --pretrained")
    folder = "--accelerate" if args.accelerate else "--transformers" if args.transformers else None
    if folder and args.step is not None:
        raise CheckpointError(f"--step does not apply to {folder}: DIR is the folder of one step already; drop "
                              f"--step and name that step's folder")
    if folder or args.output is None or not os.path.exists(args.output) or os.path.isfile(args.output):
        return
    if os.path.isdir(args.output):
        example = os.path.join(args.output, "model.ckpt" if args.lightning else "model.safetensors")
        raise CheckpointError(f"-o {args.output} is a directory: name the file to write, e.g. -o {example}")
    raise CheckpointError(f"-o {args.output} is not a regular file (a device, FIFO or socket), which the export "
                          f"would replace or write into: name a file")


def cmd_export(args) -> int:
    shown = _progress.wanted(getattr(args, "quiet", False))
    _check_export(args)
    if args.dcp is not None:
        from .interop import export_dcp

        _, path = _locate(args)
        with _watch_output(args.dcp, path, "export --dcp", shown):
            out = export_dcp(path, args.dcp, pretrained=args.pretrained)
        print(f"wrote the DCP checkpoint of step {load_manifest(path).step} to {out}")
        return 0
    if args.peft is not None:
        return _export_peft(args, shown)
    if args.output is None:
        raise CheckpointError("name the output: -o FILE, --dcp OUT_DIR for a torch.distributed.checkpoint, or --peft "
                              "OUT_DIR for a PEFT adapter")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise CheckpointError(f"cannot write {args.output}: the directory {out_dir} does not exist; create it first")
    if args.transformers:
        try:
            from transformers_layerckpt.export import export_folder as export_trainer
        except ImportError as e:
            raise CheckpointError(f"--transformers needs transformers installed (pip install 'layerckpt[transformers]'): {e}")

        print(f"wrote {export_trainer(args.dir, args.output, args.pretrained)}: a plain Trainer resumes from it")
        return 0
    if args.accelerate:
        return _export_accelerate(args, shown)
    root, path = _locate(args)
    if args.lightning:
        try:
            from lightning_layerckpt.export import export_ckpt
        except ImportError as e:
            raise CheckpointError(f"--lightning needs lightning installed (pip install 'layerckpt[lightning]'): {e}")
        with _watch_output(args.output, path, "export --lightning", shown):
            export_ckpt(path, args.output, pretrained=args.pretrained)
        print(f"wrote the Lightning checkpoint of step {load_manifest(path).step} to {args.output}")
        return 0
    return _export_safetensors(args, root, path, shown)


def _export_peft(args, shown: bool) -> int:
    from ._peft import CONFIG, WEIGHTS, export_peft

    _, path = _locate(args)
    with _progress.watching(lambda: _progress.size_of(args.peft), None, "export --peft", shown):
        out = export_peft(path, args.peft, config=args.peft_config)
    print(f"wrote the PEFT adapter of step {load_manifest(path).step} to {out} ({WEIGHTS}, {CONFIG}): "
          f"PeftModel.from_pretrained(base_model, {args.peft!r}) loads it")
    return 0


def _export_accelerate(args, shown: bool) -> int:
    try:
        from accelerate_layerckpt.export import export_folder
    except ImportError as e:
        raise CheckpointError(f"--accelerate needs accelerate installed (pip install 'layerckpt[accelerate]'): {e}")
    with _progress.watching(lambda: _progress.size_of(args.output), None, "export --accelerate", shown):
        out = export_folder(args.dir, args.output, args.pretrained)
    print(f"wrote {out}: plain accelerate's load_state reads it")
    return 0


def _watch_output(out: str, mpath: str, desc: str, shown: bool):
    """A bar of the bytes ``out`` holds, against the composite's size (raw): for exports by library calls."""
    total = sum(e.nbytes for e in load_manifest(mpath).tensors.values()) if shown else None
    return _progress.watching(lambda: _progress.size_of(out), total, desc, shown)


def _export_safetensors(args, root: str, path: str, shown: bool) -> int:
    from safetensors.torch import save_file

    from .read._pretrained import read_all

    m = load_manifest(path)
    keys = [k for k in m.logical_keys() if model_name(k) is not None]
    held = read_all(m, args.pretrained, checksum_function(m.checksum), path)  # refused first where it cannot be
    with _progress.Bar(_stored_total(m, keys), "export (read)", shown) as bar:
        ts = _read_tensors(root, m, keys, bar=bar)
    ts.update(held)
    out = {model_name(k): t for k, t in ts.items()}
    for alias, canon in m.aliases.items():
        out[alias] = out[canon].clone()
    with _progress.watching(lambda: _progress.size_of(args.output), sum(t.nbytes for t in out.values()),
                            "export (write)", shown):
        save_file(out, args.output, metadata={"format": "pt", "step": str(m.step)})
    print(f"wrote {len(out)} tensors of step {m.step} to {args.output}")
    return 0


def cmd_plot(args) -> int:
    from ._plot import figure, history

    out = figure_path(args.output, "-o")
    root, _ = _store.locate(args.dir)
    h = history(root)
    title = args.title or getattr(args, "url", None) or args.dir
    figure(h, title=title, max_rows=args.max_rows).savefig(out, dpi=120)
    print(f"wrote {args.output}: {len(h.layers)} layers x {len(h.steps)} checkpoints (steps {h.steps[0]}..{h.steps[-1]})")
    return 0


def _bench(args) -> int:
    import importlib

    from .bench import options

    kind = options.check(args)  # before any work: one mode, no option it ignores
    shown = _progress.wanted(getattr(args, "quiet", False))
    # the bench reports nothing while it runs: the bar shows this process's disk traffic and its rate
    with _progress.printing_beside(shown), _progress.watching(_progress.process_io, None, f"bench {kind} I/O", shown):
        rc = importlib.import_module("layerckpt.bench." + kind).main(args)
    if rc:  # its processes failed (sharded: torchrun's exit status); 1 is verify's alone
        raise CheckpointError(f"the benchmark's processes exited with status {rc}; their output above says why")
    return 0


def _launch(args) -> int:
    from .launch import main as launch_main

    return launch_main(args)


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command; whatever goes wrong ends as one line on stderr and exit 2 (verify's damage: 1)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version: 0; a refused argument: 2, its line printed
        return e.code if isinstance(e.code, int) else 2
    return run(args)


def _parser() -> argparse.ArgumentParser:
    from . import __version__
    from .bench.options import add_parser

    p = Parser(prog="layerckpt", description=__doc__)
    p.add_argument("--version", action="version", version=f"layerckpt {__version__}",
                   help="print the version of layerckpt and exit")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("inspect", help="per layer: persisted step, steps behind, bytes, estimated cost")
    a.add_argument("dir", help="a checkpoint directory, one of its manifests, or a URL (s3://bucket/prefix)")
    a.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    a.set_defaults(fn=cmd_inspect)
    a = sub.add_parser("verify", help="check the checksums of every committed checkpoint")
    a.add_argument("dir", help="a checkpoint directory or a URL (s3://bucket/prefix)")
    a.set_defaults(fn=cmd_verify)
    a = sub.add_parser("export", help="consolidated model weights as one safetensors file")
    a.add_argument("dir", help="a checkpoint directory, one of its manifests, or a URL; with --accelerate or "
                               "--transformers: the folder of one step")
    a.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    a.add_argument("-o", "--output", help="the file to write (with --accelerate or --transformers: a new folder)")
    a.add_argument("--dcp", metavar="OUT_DIR",
                   help="instead of -o: a torch.distributed.checkpoint directory ('model' and 'optim' as DCP's "
                        "get_model_state_dict / get_optimizer_state_dict give them)")
    a.add_argument("--peft", metavar="OUT_DIR",
                   help="instead of -o: the PEFT adapter of a PeftModel's checkpoint, as save_pretrained writes it "
                        "(adapter_model.safetensors, adapter_config.json), for PeftModel.from_pretrained")
    a.add_argument("--peft-config", metavar="PATH",
                   help="with --peft: the adapter_config.json (or a folder holding one) of a checkpoint saved without "
                        "the PEFT record")
    a.add_argument("--lightning", action="store_true",
                   help="instead: a standard Lightning .ckpt (Model.load_from_checkpoint, ckpt_path=)")
    a.add_argument("--accelerate", action="store_true",
                   help="instead: DIR is a folder save_state wrote through the plugin; -o a folder plain "
                        "accelerate's load_state reads")
    a.add_argument("--transformers", action="store_true",
                   help="instead: DIR is a checkpoint-<step> folder of an attached Trainer; -o a folder a plain "
                        "Trainer resumes from")
    a.add_argument("--pretrained", metavar="PATH",
                   help="for a checkpoint that holds tensors by reference to the pretrained weights the training "
                        "started from (Config.pretrained): that safetensors file, or folder of them (every export "
                        "but --peft, whose adapter holds none)")
    a.set_defaults(fn=cmd_export)
    a = sub.add_parser("plot", help="a figure of the store's history from its manifests: layers written, skipped "
                                    "or unchanged per checkpoint, bytes, estimated loss increase (needs the 'plot' "
                                    "extra: matplotlib)")
    a.add_argument("dir", help="a checkpoint directory or a URL (s3://bucket/prefix)")
    a.add_argument("-o", "--output", required=True, help="the figure: a .png, .svg or .pdf file")
    a.add_argument("--max-rows", type=int, default=64, help="more layers than this are drawn as this many rows")
    a.add_argument("--title", help="the figure's title (default: DIR)")
    a.set_defaults(fn=cmd_plot)
    a = sub.add_parser("shm", help="the memory tiers in /dev/shm (or LAYERCKPT_SHM) with their stores and sizes; "
                                   "--prune removes the orphans, whose store is gone")
    a.add_argument("--prune", action="store_true",
                   help="remove each tier whose store was deleted or replaced by another (it holds only copies)")
    a.set_defaults(fn=cmd_shm)
    add_parser(sub).set_defaults(fn=_bench)
    a = sub.add_parser("launch", help="run a training script; restart it when it fails, each attempt a fork of a "
                                      "process that has imported torch and the --preload modules already")
    a.add_argument("--max-restarts", type=int, default=3, help="restarts after a failed attempt (default: 3)")
    a.add_argument("--preload", action="append", metavar="MODULE[,MODULE]",
                   help="modules the script imports, imported once before the first attempt (e.g. "
                        "lightning.pytorch,transformers); torch, numpy and layerckpt always are")
    a.add_argument("--no-standby", action="store_true",
                   help="start every attempt in a new interpreter instead (as torchrun --max-restarts does)")
    a.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m MODULE does")
    a.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]",
                   help="the script and its arguments (after -m MODULE: the module's arguments; put -- first "
                        "when they start with a dash)")
    a.set_defaults(fn=_launch)
    for a in (sub.choices["verify"], sub.choices["export"], sub.choices["bench"]):
        a.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bar (one is drawn on stderr only when it is a terminal)")
    for a in (sub.choices["inspect"], sub.choices["verify"], sub.choices["export"], sub.choices["plot"]):
        a.add_argument("--remote-options", metavar="JSON",
                       help="when DIR is a URL (s3://bucket/prefix): fsspec options, e.g. credentials")
    sub.choices["bench"].add_argument("--remote-options", metavar="JSON",
                                      help="the default bench: fsspec options of --remote, e.g. credentials")
    return p


if __name__ == "__main__":
    sys.exit(main())
