"""The main job's table (``examples/lightning_finetune.py``): what it measured, as one JSON object, and the text
it prints from it.

The example writes the object with ``--json PATH``; ``python -m layerckpt.bench.report`` renders the README's
table from that file (view ``main-job``) with :func:`format_table`, the same function the example prints with, so
the README shows what the run printed.  The object holds the measurements themselves (every step's time of the
three runs, the saves' bytes and seconds, the resume times, the losses after the resume and the uninterrupted
run's), not the ratios: the table is computed from them.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple


def per_checkpoint(seconds: Sequence[float], every: int, span: slice) -> Optional[Tuple[float, float]]:
    """What each checkpoint cost a run's steps, against that run's own steps away from its checkpoints: the
    steps' total over ``span`` beyond the median of the steps that neither hold a save (batch ``i`` with
    ``i % every == every - 1``: its batch end saves) nor follow one; per save.  Runs of the same steps in other
    processes differ by 10-20% in their step time alone, which decides a difference of their totals; a run's
    steps among themselves do not.  Returns (ms per checkpoint, the baseline step in ms), or None where every
    step is next to a save (``every`` < 3)."""
    idx = range(span.start, span.stop)
    saves = sum(1 for i in idx if i % every == every - 1)
    if every < 3 or not saves:
        return None
    base = quiet_median(seconds, every, span)
    return sum(seconds[i] * 1e3 - base for i in idx) / saves, base


def quiet_median(seconds: Sequence[float], every: int, span: slice) -> float:
    """The median step, in ms, over ``span`` of the steps :func:`per_checkpoint` takes as a run's baseline."""
    return statistics.median(seconds[i] for i in range(span.start, span.stop) if i % every not in (every - 1, 0)) * 1e3


def result(args: Dict[str, int], machine: Dict[str, Any], theirs: Dict[str, float], ours: Dict[str, Any],
           steps: Dict[str, List[float]], resume_s: Dict[str, float], resumed_step: int, after: List[float],
           want: List[float]) -> Dict[str, Any]:
    """The JSON object of one run: ``args`` the job's sizes (every, crash_at, finetune, pretrain, n_layer,
    n_embd); ``theirs`` ModelCheckpoint's totals over the uninterrupted run (bytes, blocked_s, saves); ``ours``
    the killed LayerCheckpoint run's over the saves before the kill (bytes, save_return_s, step_wait_s, saves);
    ``steps`` every batch's seconds of the three runs (none, ModelCheckpoint, LayerCheckpoint); ``resume_s``
    each resume's Trainer setup to its first step; ``after`` and ``want`` the losses of the steps after the
    resume and the uninterrupted run's same steps."""
    return {"machine": machine, "main_job": dict(args), "theirs": dict(theirs), "ours": dict(ours),
            "step_s": {k: list(v) for k, v in steps.items()}, "resume_s": dict(resume_s),
            "resumed_step": resumed_step, "losses_after_resume": list(after), "losses_uninterrupted": list(want)}


def format_table(res: Dict[str, Any]) -> str:
    """What the main job prints at its end, from :func:`result`'s object."""
    a, m = res["main_job"], res["machine"]
    crash_at, every = a["crash_at"], a["every"]
    theirs, ours = res["theirs"], res["ours"]
    n = ours["saves"]  # ModelCheckpoint's saves over the same steps
    ref_bytes = theirs["bytes"] / theirs["saves"] * n
    ref_blocked = theirs["blocked_s"] / theirs["saves"] * n
    ours_blocked = ours["save_return_s"] + ours["step_wait_s"]
    bare_s, ref_s, our_s = (res["step_s"][k] for k in ("none", "ModelCheckpoint", "LayerCheckpoint"))
    # the same steps in every run: batch 1's start to batch crash_at's (batch 0 warms up)
    span = slice(1, crash_at)
    base, t_total, o_total = (sum(x[span]) for x in (bare_s, ref_s, our_s))
    med = [statistics.median(x[span]) * 1e3 for x in (bare_s, ref_s, our_s)]
    plain_s, ours_s = res["resume_s"]["ModelCheckpoint"], res["resume_s"]["LayerCheckpoint"]
    after, want = res["losses_after_resume"], res["losses_uninterrupted"]
    mean_rel = abs(sum(after) - sum(want)) / sum(want)
    commit = m.get("commit")
    lines = [
        f"examples/lightning_finetune.py: {a['n_layer']} blocks of width {a['n_embd']}, {a['pretrain']} pre-training "
        f"and {a['finetune']} fine-tuning steps, a checkpoint every {every}, killed at step {crash_at}; on {m['cpu']} "
        f"({m['cores']} cores), torch {m['torch']}, commit "
        + (f"{commit[:7]}{' with uncommitted changes' if m.get('commit_dirty') else ''}" if commit else "unknown"),
        "",
        f"over the {n} checkpoints before the kill     {'ModelCheckpoint':>16} {'LayerCheckpoint':>16} {'ratio':>8}",
        f"  bytes written                         {ref_bytes / 1e6:>14.1f}MB {ours['bytes'] / 1e6:>14.1f}MB "
        f"{ref_bytes / max(ours['bytes'], 1):>7.1f}x",
        f"  save() returned after                 {ref_blocked * 1e3:>14.0f}ms "
        f"{ours['save_return_s'] * 1e3:>14.0f}ms {ref_blocked / max(ours['save_return_s'], 1e-9):>7.1f}x",
        f"  + the next step's wait for the copies {0:>14.0f}ms {ours['step_wait_s'] * 1e3:>14.0f}ms",
        f"  = training blocked by the saves       {ref_blocked * 1e3:>14.0f}ms {ours_blocked * 1e3:>14.0f}ms "
        f"{ref_blocked / max(ours_blocked, 1e-9):>7.1f}x",
        f"  step-time overhead vs no checkpoints  {(t_total - base) * 1e3:>14.0f}ms {(o_total - base) * 1e3:>14.0f}ms "
        + (f"{(t_total - base) / (o_total - base):>7.1f}x" if o_total > base else f"{'-':>8}"),
    ]
    if o_total <= base:  # the steps' own spread covers what the saves cost: no ratio to print
        lines.append("    (LayerCheckpoint's steps took no longer than the run without checkpoints: within the steps' "
                     "noise)")
    lines.append(f"    (training time of steps 1-{crash_at - 1}: {base:.2f}s without checkpoints, {t_total:.2f}s and "
                 f"{o_total:.2f}s with; median step {med[0]:.1f}, {med[1]:.1f} and {med[2]:.1f} ms)")
    own = [per_checkpoint(x, every, span) for x in (ref_s, our_s)]
    if None not in own:
        (t_ms, t_base), (o_ms, o_base) = own
        lines += [f"  per checkpoint, against the run's own {t_ms:>12.1f}ms {o_ms:>14.1f}ms "
                  + (f"{t_ms / o_ms:>7.1f}x" if o_ms > 0 else f"{'-':>8}"),
                  f"    (each run's steps beyond its median step away from the saves and the steps after them: "
                  f"{t_base:.1f} and {o_base:.1f} ms; {quiet_median(bare_s, every, span):.1f} ms without checkpoints)"]
    lines += [f"  resume in a new process               {plain_s * 1e3:>14.0f}ms {ours_s * 1e3:>14.0f}ms "
              f"{plain_s / ours_s:>7.1f}x",
              "    (Trainer setup to the first step: reading the checkpoint and putting the state back)",
              f"  loss after resume vs uninterrupted    mean over the {len(after)} steps after the resume within "
              f"{mean_rel * 100:.3f}%{' (bit-identical)' if after == want else ''}; final loss {after[-1]:.4f} vs "
              f"{want[-1]:.4f}"]
    return "\n".join(lines)
