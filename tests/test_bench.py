"""`layerckpt bench` runs end to end (tiny preset: a smoke test, not a measurement)."""
import json
import math
import statistics
import subprocess
import sys

import pytest

from layerckpt.bench.cases import build_state, state_bytes


def _layer_bytes(model, opt, prefix: str) -> int:
    """A layer's weights and AdamW state, counted from the live objects."""
    return sum(p.numel() * p.element_size() + sum(v.numel() * v.element_size() for v in opt.state[p].values())
               for n, p in model.named_parameters() if n.startswith(prefix))


def _check_timings(run: dict) -> None:
    """Medians between their min and max; a save is durable no earlier than it returned."""
    for key in ("durable_s", "restore_s", "stall_s"):
        if key in run:
            assert 0 < run[f"{key[:-2]}_min_s"] <= run[key] <= run[f"{key[:-2]}_max_s"], (key, run)
    if "stall_s" in run:
        assert run["stall_s"] <= run["durable_s"], run
    if "step_wait_s" in run:  # layerckpt: what training waits for is save()'s return plus the next step's wait
        assert [a + b for a, b in zip(run["stall_all_s"], run["step_wait_all_s"])] == run["blocked_all_s"], run
    elif "blocked_s" in run:  # a synchronous save: the call is what training waits for
        assert run["blocked_all_s"] == run["stall_all_s"], run


def _check_ratios(res: dict) -> None:
    """Each ratio is the quotient its name says, of this run's own figures (a tiny state's timings are noise, so
    no range is asserted for their values beyond being finite)."""
    lc, runs, disk = res["runs"]["layerckpt"], res["runs"], res["disk"]
    want = {"durable_vs_odirect_write": lc["durable_s"] / disk["write_s"],
            "stall_vs_memcpy": lc["stall_s"] / res["memcpy_s"],
            "blocked_vs_memcpy": lc["blocked_s"] / res["memcpy_s"],
            "restore_vs_odirect_read": lc["restore_s"] / disk["read_s"],
            "restore_vs_odirect_read_fresh_memory": lc["restore_s"] / disk["read_fresh_s"],
            "extra_mem_vs_state": lc["extra_mem_bytes"] / res["state_bytes"],
            "extra_mem_over_pool_vs_state": (lc["extra_mem_bytes"] - lc["pool_bytes"]) / res["state_bytes"],
            "dcp_async_durable_over_ours": runs["dcp"]["async_durable_s"] / lc["durable_s"],
            "dcp_async_stall_over_ours": runs["dcp"]["async_stall_s"] / lc["stall_s"],
            "dcp_async_stall_over_our_blocked": runs["dcp"]["async_stall_s"] / lc["blocked_s"]}
    raw = runs["layerckpt raw"]
    want.update(raw_bytes_over_encoded=raw["bytes"] / lc["bytes"], encoded_durable_over_raw=lc["durable_s"] /
                raw["durable_s"], encoded_restore_over_raw=lc["restore_s"] / raw["restore_s"])
    for name in ("torch.save", "safetensors", "dcp"):
        want[f"{name}_durable_over_ours"] = runs[name]["durable_s"] / lc["durable_s"]
        want[f"{name}_restore_over_ours"] = runs[name]["restore_s"] / lc["restore_s"]
    assert res["ratios"] == pytest.approx(want, rel=1e-9)
    assert all(math.isfinite(v) and v > 0 for k, v in res["ratios"].items() if k != "extra_mem_over_pool_vs_state")


def test_bench_tiny_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "bench", "--preset", "tiny", "--reps", "2",
                        "--dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert set(res["runs"]) == {"layerckpt", "layerckpt raw", "torch.save", "safetensors", "dcp"}
    lc, raw = res["runs"]["layerckpt"], res["runs"]["layerckpt raw"]
    model, opt = build_state("tiny")
    assert res["state_bytes"] == state_bytes(model, opt)
    # a raw full save is the state once (the tied head not again), plus RNG states, header and alignment: 27 KiB
    assert raw["restore_bit_exact"] and res["state_bytes"] < raw["bytes"] <= res["state_bytes"] + 40 * 1024
    # encoded (the default): the same saves, fewer bytes, restored bit for bit
    assert lc["encoding"] == "delta" and raw["encoding"] == "off"
    assert lc["restore_bit_exact"] and lc["bytes"] < raw["bytes"]
    rows = res["selective"]
    assert [r["blocks_moved"] for r in rows] == [0, 1, 2, 4]
    # each moved block adds its weights and AdamW state (and at most 8 KiB of header and alignment), nothing else
    block = _layer_bytes(model, opt, "h.0.")
    assert rows[0]["bytes"] < 32 * 1024  # nothing moved: the small state only
    for r in rows:
        k = r["blocks_moved"]
        assert k * block <= r["bytes"] - rows[0]["bytes"] <= k * (block + 8 * 1024), (r, block)
    for run in res["runs"].values():
        _check_timings(run)
    _check_ratios(res)
    # the memory and remote tiers each got every save of their run (a warm-up and max(2, reps - 1) timed)
    assert res["tiers"]["restore_bit_exact"] and res["tiers"]["files_copied"] == [3, 3]
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself


def test_bench_restore_tiny_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "bench", "--restore", "--sizes", "2MB", "--reps", "1",
                        "--cache", "warm", "--dir", str(tmp_path), "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["sizes"]
    assert set(row["seconds"]["warm"]) == {"layerckpt", "torch.load", "dcp.load"}
    secs = row["seconds"]["warm"]
    assert all(len(ts) == 1 and ts[0] > 0 for ts in secs.values())
    assert row["bit_exact"]["layerckpt"] is True
    # the ratios are the contenders' medians over ours (>1: layerckpt resumes faster)
    assert row["ratios"]["warm"] == pytest.approx(
        {f"{k}/ours": statistics.median(secs[k]) / statistics.median(secs["layerckpt"]) for k in ("torch.load", "dcp.load")},
        rel=1e-9)
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself
