"""Every verdict the other benches print (besides ``bench --goodput``'s: tests/test_bench_goodput_targets.py),
judged on hand-made figures: each one where it holds and where it fails."""
import json
import os

import pytest

from layerckpt import Config
from layerckpt.bench import policy

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


def _json(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("ratio, says", [(4.0, "4.00x, met"), (2.0, "2.00x, met"), (1.99, "1.99x, NOT met"),
                                         (0.8, "0.80x, NOT met")])
def test_sharded_target(ratio, says):
    from layerckpt.bench.sharded import format_table

    res = _json("gpt2-small-sharded-2rank-2core.json")
    res["ratios"]["dcp.save durable / full durable"] = ratio
    line = next(x for x in format_table(res).splitlines() if x.startswith("target: "))
    assert line.endswith(says), line


@pytest.mark.parametrize("gbps, says", [(5.0, "encoding keeps up with the disk"),
                                        (1.0, "encoded saves are durable later than raw ones here")])
def test_full_save_encoding_verdict(gbps, says):
    from layerckpt.bench.run import format_table

    res = _json("full-save-gpt2-small-2core-epyc-encoder.json")  # its disk writes the state at 3.1 GB/s
    res["compression"]["gbps"] = gbps
    line = next(x for x in format_table(res).splitlines() if "GB/s, " in x and "the disk writes" in x)
    assert says in line, line


def _policy_row(workload="lora", deviations=(0.001, -0.002, 0.004), written=10, frontier=None, **kw):
    row = {"workload": workload, "saves": 4, "ratio": 20.0, "bytes": written, "written_bytes": written,
           "full_bytes": 200, "crashes": [{"step": 5 * (i + 1), "deviation": d, "behind": 0}
                                          if d is not None else {"step": 5 * (i + 1), "refused": "MissingDataError"}
                                          for i, d in enumerate(deviations)], **kw}
    if frontier is not None:
        row["frontier"] = frontier
    return row


@pytest.mark.parametrize("row, ok", [
    (_policy_row(), True),  # 20x written, every restore within 0.5%
    (_policy_row(deviations=(0.001, 0.006, 0.0)), False),  # a restore 0.6% above
    (_policy_row(deviations=(0.001, -0.006, 0.0)), False),  # and below
    (_policy_row(deviations=(0.001, None, 0.0)), False),  # a restore refused
    (_policy_row(written=21), False),  # 9.5x, under lora's 10x
    (_policy_row("scratch-1e-3", written=190), True),  # no bytes target for training from scratch
    (_policy_row(frontier={"ok": False}), False),  # more steps lost than the full checkpoints' frontier
    (_policy_row(encoding="lossy", written=4, cycles={"deviation": 0.009}), True),  # 50x, 0.9% after five
    (_policy_row(encoding="lossy", written=4, cycles={"deviation": -0.011}), False),
    (_policy_row(encoding="lossy", written=5, cycles={"deviation": 0.0}), False),  # 40x, under lora's lossy 50x
])
def test_policy_verdict(row, ok):
    assert policy.meets(row) is ok
    line = policy.format_table([row], Config()).splitlines()[2]
    assert line.endswith(" ok" if ok else " MISSED"), line


@pytest.mark.parametrize("deviation, says", [(0.004, "ok"), (-0.004, "ok"), (0.006, "MISSED"), (-0.006, "MISSED")])
def test_through_verdict(deviation, says):
    row = {**_policy_row(deviations=(0.001, deviation)), "through": "trainer"}
    text = policy.format_through({"rows": [], "through": [row]})
    line = next(x for x in text.splitlines() if x.startswith("lora"))
    assert line.endswith(says), line


@pytest.mark.parametrize("ok", [True, False])
def test_frontier_verdict_is_printed_as_judged(ok):
    """The judgment itself (policy._frontier: accepted, no more lost than the frontier, the full check's lag 0)
    runs in test_bench.py's end-to-end frontier test; here the table prints either verdict."""
    from layerckpt.bench.frontier import format_frontier

    d = {"raw": 100.0, "bytes": 90.0, "lost": 3.0, "since": 2.0, "lag": 1.0}
    f = {"default": d, "full": [{"k": 1, "bytes": 400.0, "lost": 2.0}], "frontier_lost": 2.5, "ok": ok,
         "ratio": 4.4}
    line = format_frontier([{"workload": "lora", "frontier": f}]).splitlines()[2]
    assert line.split()[-3] == ("ok" if ok else "MISSED"), line
