"""The options of ``layerckpt bench``: its parser, which benchmark (mode) runs, and the checks made before any
work: one mode at most, no option that mode ignores, values the mode can use.

Options a mode uses have no argparse default, so that one given to a mode that ignores it is seen and refused;
:func:`check` fills the defaults of the mode that runs.
"""
from __future__ import annotations

import argparse
from typing import Dict, Tuple

from ..errors import CheckpointError

#: mode flag (the args attribute) -> the bench module that runs it; no flag: ``run``
MODES: Dict[str, str] = {"sharded": "sharded", "lightning": "lightning_io", "policy": "policy",
                         "restore": "restore", "steps": "steps", "cpu": "cpu", "goodput": "goodput",
                         "lossy": "lossy", "nodes": "nodes"}
DEFAULT = "run"

#: bench module -> the options (args attributes) it reads beside --dir, --json and --quiet
USES: Dict[str, Tuple[str, ...]] = {
    "run": ("preset", "reps", "config", "chunk_bytes", "queue_depth", "only", "remote", "remote_options"),
    "policy": ("config", "workloads", "plot", "through", "encodings", "pretrained"),
    "sharded": ("size", "reps", "nproc", "mesh", "encoding"),
    "lightning_io": ("size", "reps"),
    "restore": ("sizes", "cache", "reps"),
    "steps": ("size", "steps_n", "steps_every", "steps_rounds"),
    "cpu": ("cpu_models", "cpu_saves", "cpu_contenders"),
    "goodput": ("size", "mtbf", "goodput_steps", "failure", "seed", "cadences", "restarts", "grace",
                "save_on_exception"),
    "lossy": ("workloads",),
    "nodes": ("size", "reps", "nproc", "steps_n", "steps_every", "steps_rounds"),
}

#: the defaults :func:`check` fills in for the mode that runs
DEFAULTS = {"preset": "gpt2-small", "reps": 3, "size": "gpt2-small", "nproc": 2, "steps_n": 6, "steps_every": 1,
            "steps_rounds": 2,
            "sizes": "10MB,50MB,200MB,gpt2-small", "cache": "warm,files,cold", "cpu_models": "main,gpt2-small",
            "mtbf": "60", "through": "core", "goodput_steps": 300, "failure": "crash,node", "seed": 0, "cadences": "10,25,50",
            "restarts": "fresh", "grace": "10", "save_on_exception": False}
#: where a mode's default differs from DEFAULTS'
MODE_DEFAULTS = {"goodput": {"size": "gpt2-mini"},
                 "nodes": {"size": "gpt2-mini", "nproc": 1, "steps_n": 12, "steps_every": 4, "steps_rounds": 2}}


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one, 1 or more") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is less than 1; give 1 or more")
    return n


def add_parser(sub) -> argparse.ArgumentParser:
    a = sub.add_parser("bench", help="time layerckpt against torch.save, safetensors and DCP (one benchmark: the "
                                     "default, or one of --policy, --sharded, --nodes, --lightning, --restore, "
                                     "--steps, --cpu, --goodput, --lossy)")
    a.add_argument("--preset", choices=["gpt2-small", "tiny"],
                   help="the default bench: the state to save (default: gpt2-small)")
    a.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    a.add_argument("--reps", type=_positive,
                   help="the default bench, --sharded, --nodes, --lightning, --restore: timed repeats (default: 3)")
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.add_argument("--config", metavar="YAML", help="the default bench, --policy: a layerckpt YAML config")
    a.add_argument("--chunk-bytes", type=_positive, help="the default bench: Config.chunk_bytes")
    a.add_argument("--queue-depth", type=_positive, help="the default bench: Config.queue_depth")
    a.add_argument("--only", nargs="+", choices=["layerckpt", "selective", "torch.save", "safetensors", "dcp", "tiers"],
                   help="the default bench: only these contenders (default: all)")
    a.add_argument("--remote", metavar="URL",
                   help="the default bench: the remote tier for 'tiers' (default: a folder beside --dir)")
    a.add_argument("--policy", action="store_true",
                   help="instead: the selection defaults on the workload family (bytes, loss after restore)")
    a.add_argument("--workloads", nargs="+", help="with --policy or --lossy: which workloads (default: all)")
    a.add_argument("--lossy", action="store_true",
                   help="instead: a study of bounded-loss codes on the workload family (bytes against raw full "
                        "checkpoints, loss after one restore and after five; in memory, not through the store)")
    a.add_argument("--through",
                   help="with --policy: comma-separated, core (the Checkpointer) and/or the adapters lightning, "
                        "accelerate, trainer: each trains and resumes the family its framework's way "
                        "(default: core)")
    a.add_argument("--encodings",
                   help="with --policy: comma-separated Config.encoding values, each run on every workload, one row "
                        "apiece (e.g. auto,lossy; default: the config's)")
    a.add_argument("--pretrained", action="store_true", default=None,
                   help="with --policy: each workload that starts from the family's pre-trained weights names them "
                        "in Config.pretrained (frozen tensors held by reference, not written)")
    a.add_argument("--plot", metavar="FILE",
                   help="with --policy: the steps-lost frontiers as a .png, .svg or .pdf (needs matplotlib)")
    a.add_argument("--sharded", action="store_true",
                   help="instead: an FSDP2 model on --nproc processes (launches torchrun itself) against "
                        "dcp.save, async_save and load")
    a.add_argument("--nodes", type=_positive, nargs="?", const=2, metavar="N",
                   help="instead: N simulated nodes (default: 2; torchrun node launchers on this host, --nproc "
                        "processes each, launched by the bench): full saves to node-local directories against one "
                        "shared directory and dcp.save, the replicas' lag and bytes (replicas=1), step time with "
                        "replicas=0 and 1, and restores after a process crash and a node's loss (partner replica, "
                        "remote tier) against dcp.load")
    a.add_argument("--lightning", action="store_true",
                   help="instead: lightning_layerckpt.LayerCheckpointIO against Lightning's TorchCheckpointIO and "
                        "AsyncCheckpointIO on a Trainer's checkpoint dict (time blocked, time to durable)")
    a.add_argument("--restore", action="store_true",
                   help="instead: resume time by checkpoint size (fresh process; warm, files-cold, cold page cache) "
                        "against torch.load + load_state_dict and dcp.load")
    a.add_argument("--steps", action="store_true",
                   help="instead: step time of a training loop with a checkpoint after every step: layerckpt "
                        "against DCP async_save and TorchSnapshot async_take (with --size, --steps-n)")
    a.add_argument("--steps-n", type=_positive, help="with --steps: steps measured (default: 6); with --nodes: "
                                                     "steps per round of each step-time run (default: 12)")
    a.add_argument("--cpu", action="store_true",
                   help="instead: CPU time per checkpoint (all threads, until its background work ended) of "
                        "torch.save and layerckpt's default, forced delta and off, selective and full, beside the "
                        "floor of one copy and checksum of the state")
    a.add_argument("--cpu-models",
                   help="with --cpu: comma-separated models, 'main' (the main job's) and/or 'gpt2-small' "
                        "(default: main,gpt2-small)")
    a.add_argument("--cpu-saves", type=_positive,
                   help="with --cpu: checkpoints timed per contender, after 2 untimed ones (default: each model's "
                        "own, 22 of the main job's model, 4 of GPT-2 small)")
    a.add_argument("--cpu-contenders",
                   help="with --cpu: comma-separated contenders (default: torch.save and layerckpt's unsigned "
                        "ones; 'layerckpt full signed' and 'layerckpt full off signed' on request)")
    a.add_argument("--steps-every", type=_positive,
                   help="with --steps: a full checkpoint every N steps instead, the default Config against "
                        "encoding delta and off forced (default: 1); with --nodes: the step-time runs' save "
                        "interval (default: 4)")
    a.add_argument("--steps-rounds", type=_positive,
                   help="with --steps-every N > 1: rounds of every contender, each round in the reverse order of "
                        "the one before, the disk settled before each contender (default: 2); with --nodes: the "
                        "step-time runs' rounds (default: 2)")
    a.add_argument("--sizes", help="with --restore: comma-separated state sizes (e.g. 10MB) and/or gpt2-small "
                                   "(default: 10MB,50MB,200MB,gpt2-small)")
    a.add_argument("--cache", help="with --restore: page-cache conditions, of warm (the files read once before), "
                   "files (the checkpoint's files dropped from the page cache, as after a crash) and cold "
                   "(drop_caches: every cache of the machine dropped, as after a reboot) (default: all three)")
    a.add_argument("--goodput", action="store_true",
                   help="instead: a training job (plain loop and Lightning) SIGKILLed at failure times drawn with mean "
                        "--mtbf and restarted until done, per contender (layerckpt, its mtbf= interval, "
                        "ModelCheckpoint, dcp.async_save, torch.save): goodput and where the wall time went")
    a.add_argument("--mtbf",
                   help="with --goodput: the mean time between failures, seconds or e.g. 90s, 2m (default: 60)")
    a.add_argument("--goodput-steps", type=_positive, help="with --goodput: the job's steps (default: 300)")
    a.add_argument("--failure", help="with --goodput: comma-separated failure kinds, crash (the process), node "
                                     "(the local store and /dev/shm lost too) and/or preempt (a notice, SIGTERM, then "
                                     "SIGKILL after --grace) (default: crash,node)")
    a.add_argument("--grace", help="with --goodput --failure preempt: seconds from the notice to the SIGKILL, or e.g. "
                                   "30s, 1m (default: 10)")
    a.add_argument("--save-on-exception", action="store_const", const=True,
                   help="with --goodput --failure preempt: ModelCheckpoint also saves on the SIGTERMException of "
                        "Lightning's handler (save_on_exception=True, Lightning's opt-in; default: its default, no "
                        "save)")
    a.add_argument("--seed", type=int, help="with --goodput: the seed of the failure times (default: 0)")
    a.add_argument("--cadences", help="with --goodput: comma-separated fixed intervals in steps for the contenders "
                                      "that save every N steps; each one's best is marked (default: 10,25,50)")
    a.add_argument("--restarts", help="with --goodput: how a killed job starts again, comma-separated: fresh (a new "
                                      "interpreter, as torchrun restarts) and/or standby (a fork of a layerckpt "
                                      "launch process that has imported the job's modules) (default: fresh)")
    a.add_argument("--size", choices=["gpt2-small", "gpt2-mini", "tiny"],
                   help="with --sharded, --lightning or --steps: the model (default: gpt2-small); with --goodput "
                        "or --nodes (default: gpt2-mini)")
    a.add_argument("--nproc", type=_positive, help="with --sharded: processes (default: 2); with --nodes: processes "
                                                   "per node (default: 1)")
    a.add_argument("--mesh", help="with --sharded, instead of --nproc: DxT, FSDP2 over D x tensor parallel over T "
                                  "(D * T processes)")
    a.add_argument("--encoding", choices=["auto", "delta", "compress", "off"],
                   help="with --sharded: layerckpt's Config.encoding (default: Config's)")
    return a


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _mode_name(kind: str) -> str:
    flag = next((f for f, k in MODES.items() if k == kind), None)
    return f"bench {_flag(flag)}" if flag else "bench without a mode flag"


def check(args) -> str:
    """The bench module to run for ``args``, after refusing two modes at once, an option the mode ignores and
    values it cannot use (all before any work); fills the mode's defaults into ``args``.  Raises CheckpointError
    naming the option."""
    given = [f for f in MODES if getattr(args, f, False)]
    if len(given) > 1:
        raise CheckpointError(f"{' and '.join(_flag(f) for f in given)} are different benchmarks: give one of them "
                              f"(or none, for the default bench)")
    kind = MODES[given[0]] if given else DEFAULT
    for dest in _ALL:
        if dest not in USES[kind] and getattr(args, dest, None) is not None:
            users = [_mode_name(k) for k, uses in USES.items() if dest in uses]
            raise CheckpointError(f"{_flag(dest)} does not apply to {_mode_name(kind)}: drop it ({_flag(dest)} is "
                                  f"for {', '.join(users)})")
    if kind == "sharded" and args.mesh is not None:
        if args.nproc is not None:
            raise CheckpointError(f"--nproc does not apply with --mesh {args.mesh}: the mesh sets the processes "
                                  f"(D * T); drop --nproc")
        from .sharded import parse_mesh

        parse_mesh(args.mesh)  # a malformed mesh: its message, before torchrun starts
    if kind in ("policy", "lossy"):
        _check_policy(args)
    for dest, value in DEFAULTS.items():
        if dest in USES[kind] and getattr(args, dest, None) is None:
            setattr(args, dest, MODE_DEFAULTS.get(kind, {}).get(dest, value))
    if kind == "goodput":
        _check_goodput(args)
    if kind == "nodes":
        _check_nodes(args)
    return kind


#: every mode's options, in the order of USES: the first one refused is named
_ALL = list(dict.fromkeys(d for uses in USES.values() for d in uses))


def _check_policy(args) -> None:
    if getattr(args, "workloads", None):
        from .family import WORKLOADS

        unknown = [w for w in args.workloads if w not in WORKLOADS]
        if unknown:
            raise CheckpointError(f"--workloads: no workload named {', '.join(unknown)}; name some of "
                                  f"{', '.join(WORKLOADS)} (or drop --workloads for all)")
    if getattr(args, "encodings", None) is not None:
        from ..config import ENCODINGS

        bad = [e for e in args.encodings.split(",") if e.strip() not in ENCODINGS]
        if bad or not args.encodings.strip():
            raise CheckpointError(f"--encodings: {', '.join(map(repr, bad)) or 'nothing'} given; name some of "
                                  f"{', '.join(ENCODINGS)}, comma-separated")
    if getattr(args, "through", None) is not None:
        from .policy_through import parse_through

        parse_through(args.through)  # a wrong name or a framework not installed: refused before any work
    if getattr(args, "plot", None):
        from .._cli_run import figure_path

        figure_path(args.plot, "--plot")  # where plot would write nothing, or fail after the whole run


def _check_goodput(args) -> None:
    from ..interval import parse_duration

    parse_duration(args.mtbf, "--mtbf")
    parse_duration(args.grace, "--grace")
    kinds = [k.strip() for k in args.failure.split(",")]
    if not kinds or any(k not in ("crash", "node", "preempt") for k in kinds) or len(set(kinds)) < len(kinds):
        raise CheckpointError(f"--failure {args.failure}: give crash, node and/or preempt, comma-separated (e.g. "
                              f"crash,node)")
    try:
        cadences = [int(x) for x in args.cadences.split(",")]
    except ValueError:
        cadences = []
    if not cadences or min(cadences) < 1 or len(set(cadences)) < len(cadences):
        raise CheckpointError(f"--cadences {args.cadences}: give distinct whole numbers of steps, 1 or more, "
                              f"comma-separated (e.g. 10,25,50)")
    modes = [m.strip() for m in args.restarts.split(",")]
    if not modes or any(m not in ("fresh", "standby") for m in modes) or len(set(modes)) < len(modes):
        raise CheckpointError(f"--restarts {args.restarts}: give fresh, standby or fresh,standby")


def _check_nodes(args) -> None:
    if args.nodes < 2:
        raise CheckpointError(f"--nodes {args.nodes}: give 2 or more nodes (one node has no node-local directories "
                              f"to compare, nor a partner to hold its replica)")
    if args.steps_every >= args.steps_n:
        raise CheckpointError(f"--steps-every {args.steps_every} with --steps-n {args.steps_n}: no save inside a "
                              f"round; give --steps-every below --steps-n")
