"""`layerckpt bench` runs end to end (tiny preset: a smoke test, not a measurement)."""
import json
import math
import re
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


BASE_RATIOS = {"durable_vs_odirect_write", "durable_vs_odirect_overwrite", "stall_vs_memcpy", "blocked_vs_memcpy", "restore_vs_odirect_read",
               "restore_vs_odirect_read_fresh_memory", "extra_mem_vs_state", "extra_mem_over_pool_vs_state"}
ALL_RATIOS = BASE_RATIOS | {
    "delta_bytes_over_ours", "delta_durable_over_ours", "delta_restore_over_ours",
    "off_bytes_over_ours", "off_durable_over_ours", "off_restore_over_ours",
    "torch.save_durable_over_ours", "torch.save_restore_over_ours",
    "safetensors_durable_over_ours", "safetensors_restore_over_ours",
    "dcp_durable_over_ours", "dcp_restore_over_ours",
    "dcp_async_durable_over_ours", "dcp_async_stall_over_ours", "dcp_async_stall_over_our_blocked"}


def _check_ratios(res: dict) -> None:
    """Every ratio of a full run is there (what each is: test_ratios_are_the_quotients_their_names_say); a tiny
    state's timings are noise, so no range is asserted for their values beyond being finite."""
    assert set(res["ratios"]) == ALL_RATIOS
    assert all(math.isfinite(v) and v > 0 for k, v in res["ratios"].items() if k != "extra_mem_over_pool_vs_state")


def test_ratios_are_the_quotients_their_names_say():
    """Figures chosen so that every quotient is exact and none is 1 (a swapped quotient shows): worked out by hand."""
    from layerckpt.bench.run import _ratios

    ours = {"durable_s": 2.0, "stall_s": 0.5, "blocked_s": 1.0, "restore_s": 4.0, "bytes": 1000,
            "extra_mem_bytes": 300, "pool_bytes": 100}
    res = {"runs": {"layerckpt": ours,
                    "layerckpt delta": {"bytes": 800, "durable_s": 3.0, "restore_s": 2.0},
                    "layerckpt off": {"bytes": 1500, "durable_s": 1.0, "restore_s": 6.0},
                    "torch.save": {"durable_s": 8.0, "restore_s": 10.0},
                    "safetensors": {"durable_s": 5.0, "restore_s": 1.0},
                    "dcp": {"durable_s": 6.0, "restore_s": 12.0, "async_durable_s": 7.0, "async_stall_s": 0.25}},
           "disk": {"write_s": 0.5, "read_s": 2.0, "read_fresh_s": 16.0, "overwrite_s": 0.25}, "memcpy_s": 0.125,
           "state_bytes": 400}
    base = {"durable_vs_odirect_write": 4.0,  # 2.0 s / 0.5 s
            "durable_vs_odirect_overwrite": 8.0,  # 2.0 s / 0.25 s (over a written file)
            "stall_vs_memcpy": 4.0,  # 0.5 s / 0.125 s
            "blocked_vs_memcpy": 8.0,  # 1.0 s / 0.125 s
            "restore_vs_odirect_read": 2.0,  # 4.0 s / 2.0 s
            "restore_vs_odirect_read_fresh_memory": 0.25,  # 4.0 s / 16.0 s
            "extra_mem_vs_state": 0.75,  # 300 B / 400 B
            "extra_mem_over_pool_vs_state": 0.5}  # (300 - 100) B / 400 B
    assert _ratios(res) == pytest.approx({
        **base,
        "delta_bytes_over_ours": 0.8, "delta_durable_over_ours": 1.5, "delta_restore_over_ours": 0.5,
        "off_bytes_over_ours": 1.5, "off_durable_over_ours": 0.5, "off_restore_over_ours": 1.5,
        "torch.save_durable_over_ours": 4.0, "torch.save_restore_over_ours": 2.5,
        "safetensors_durable_over_ours": 2.5, "safetensors_restore_over_ours": 0.25,
        "dcp_durable_over_ours": 3.0, "dcp_restore_over_ours": 3.0,
        "dcp_async_durable_over_ours": 3.5,  # 7.0 s / 2.0 s
        "dcp_async_stall_over_ours": 0.5,  # 0.25 s / 0.5 s: the async save's return against ours
        "dcp_async_stall_over_our_blocked": 0.25}, rel=1e-12)  # 0.25 s / 1.0 s
    assert set(_ratios(res)) == ALL_RATIOS
    # only what ran is compared: layerckpt alone gives its own seven; without layerckpt, nothing
    assert _ratios({**res, "runs": {"layerckpt": ours}}) == pytest.approx(base, rel=1e-12)
    assert _ratios({**res, "runs": {"torch.save": res["runs"]["torch.save"]}}) == {}


def test_bench_tiny_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "bench", "--preset", "tiny", "--reps", "2",
                        "--dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert set(res["runs"]) == {"layerckpt", "layerckpt delta", "layerckpt off", "torch.save", "safetensors", "dcp"}
    lc, delta, raw = res["runs"]["layerckpt"], res["runs"]["layerckpt delta"], res["runs"]["layerckpt off"]
    model, opt = build_state("tiny")
    assert res["state_bytes"] == state_bytes(model, opt)
    # a raw full save is the state once (the tied head not again), plus RNG states, header and alignment: 27 KiB
    assert raw["restore_bit_exact"] and res["state_bytes"] < raw["bytes"] <= res["state_bytes"] + 40 * 1024
    # delta-encoded: the same saves, fewer bytes, restored bit for bit; the default ('auto') encodes only what pays
    assert lc["encoding"] == "auto" and delta["encoding"] == "delta" and raw["encoding"] == "off"
    assert delta["restore_bit_exact"] and delta["bytes"] < raw["bytes"]
    assert lc["restore_bit_exact"] and lc["bytes"] <= raw["bytes"]
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
                        "--cache", "warm,files", "--dir", str(tmp_path), "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    (row,) = res["sizes"]
    assert set(row["seconds"]) == set(row["major_faults"]) == {"warm", "files"}
    assert set(row["seconds"]["warm"]) == set(row["seconds"]["files"]) == {"layerckpt", "torch.load", "dcp.load"}
    assert all(len(n) == 1 and isinstance(n[0], int) and n[0] >= 0
               for per in row["major_faults"].values() for n in per.values())
    from layerckpt.bench.restore import format_table

    table = format_table(res)
    assert "2MB files:" in table and "major page faults in the timed load" in table
    secs = row["seconds"]["warm"]
    assert all(len(ts) == 1 and ts[0] > 0 for ts in secs.values())
    assert row["bit_exact"]["layerckpt"] is True
    # one repeat: each ratio is that contender's one time over ours (>1: layerckpt resumes faster); the median
    # the bench takes of more repeats: test_summary_is_the_median_and_spread
    (ours,), (torch_load,), (dcp_load,) = secs["layerckpt"], secs["torch.load"], secs["dcp.load"]
    assert row["ratios"]["warm"] == pytest.approx({"torch.load/ours": torch_load / ours,
                                                   "dcp.load/ours": dcp_load / ours}, rel=1e-12)
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself


def test_summary_is_the_median_and_spread():
    from layerckpt.bench.cases import summary

    assert summary([0.3, 0.1, 0.2]) == {"median": 0.2, "min": 0.1, "max": 0.3, "all": [0.3, 0.1, 0.2]}
    assert summary([4.0, 1.0, 3.0, 2.0])["median"] == 2.5  # an even count: the mean of the middle two
    assert summary([5.0]) == {"median": 5.0, "min": 5.0, "max": 5.0, "all": [5.0]}


# ------------------------------------------------------------------ bench --policy: steps lost per crash
def test_steps_since_counts_from_the_newest_save_at_or_before_the_crash():
    from layerckpt.bench.frontier import crash_points, mean_steps_since, steps_since

    assert steps_since(12, [5, 10, 15]) == 2 and steps_since(10, [5, 10, 15]) == 0
    assert steps_since(4, [5, 10]) == 4  # no save yet: everything is trained again
    # 8 points over 200 steps land at every phase of a 40-step cadence: its mean is the uniform mean, 19.5
    points = crash_points(200)
    assert points == [12, 37, 62, 87, 112, 137, 162, 187]
    assert mean_steps_since(points, range(40, 201, 40)) == 19.5
    assert mean_steps_since(points, range(5, 201, 5)) == 2.0


def test_lag_places_the_excess_on_the_monotone_fit():
    from layerckpt.bench.frontier import isotonic_decreasing, lag_steps

    assert isotonic_decreasing([3.0, 1.0, 2.0, 0.0]) == [3.0, 1.5, 1.5, 0.0]
    curve = [10.0 - s for s in range(11)]  # one unit of held-out loss per step
    assert lag_steps(curve, 6, curve[6]) == 0.0  # a bit-exact restore: no lag
    assert lag_steps(curve, 6, curve[6] - 0.5) == 0.0  # better than the run: no lag either
    assert lag_steps(curve, 6, curve[6] + 2.5) == pytest.approx(2.5)
    assert lag_steps(curve, 6, 100.0) == 6.0  # worse than the start: at most the whole run
    # a curve sampled every 5 steps (the saves): linear in between
    assert lag_steps(curve[::5], 10, curve[10] + 2.5, at=[0, 5, 10]) == pytest.approx(2.5)
    assert lag_steps(curve[::5], 10, curve[10] + 7.0, at=[0, 5, 10]) == pytest.approx(7.0)
    # a plateau: an excess within the curve's scatter around its fit is no lag at all
    flat = [1.0, 0.5, 0.5, 0.51, 0.49, 0.5, 0.5]
    assert lag_steps(flat, 5, 0.501) == 0.0
    hi, lo = 1.51 / 3, 1.49 / 3  # the fit pools steps 1-3 and 4-6
    assert isotonic_decreasing(flat) == pytest.approx([1.0, hi, hi, hi, lo, lo, lo])
    # 0.1 above the run at step 5: the fit is 0.1 above its step-5 value between steps 0 and 1
    assert lag_steps(flat, 5, 0.6) == pytest.approx(5 - (1 - (lo + 0.1 - hi) / (1.0 - hi)))


def test_frontier_interpolates_in_log_bytes_and_clamps_outside():
    from layerckpt.bench.frontier import frontier_at

    points = [(400.0, 2.0), (200.0, 4.5), (100.0, 9.5), (50.0, 19.5)]
    assert frontier_at(points, 200.0) == 4.5
    assert frontier_at(points, math.sqrt(400.0 * 200.0)) == pytest.approx(3.25)  # halfway in log bytes
    assert frontier_at(points, 1000.0) == 2.0 and frontier_at(points, 10.0) == 19.5
    with pytest.raises(ValueError, match="no point"):
        frontier_at([(0, 5.0)], 10.0)


def test_policy_frontier_end_to_end(tmp_path):
    """One short workload through the real engine: the new columns, and bytes written = the store's data files."""
    import os

    import layerckpt
    from layerckpt.bench import policy
    from layerckpt.bench.family import WORKLOADS
    from layerckpt.bench.frontier import format_frontier

    r = policy.run(WORKLOADS["frozen-backbone"], layerckpt.Config(), str(tmp_path), crashes=(0.5,), steps=40,
                   frontier=True)
    data = tmp_path / "default" / "data"
    assert r["written_bytes"] == sum(os.path.getsize(data / f) for f in os.listdir(data))
    f = r["frontier"]
    assert f["default"]["bytes"] == r["written_bytes"] and f["default"]["raw"] == r["bytes"]
    assert [p["k"] for p in f["full"]][:4] == [1, 2, 4, 8] and [p["saves"] for p in f["full"]][:4] == [8, 4, 2, 1]
    # each cadence has a store of its own (encoded against its own previous saves): fewer saves, fewer bytes
    assert f["full"][0]["bytes"] > f["full"][1]["bytes"] > f["full"][2]["bytes"] > f["full"][3]["bytes"] > 0
    # only the head trains: full saves carry the frozen backbone proven unchanged, and write what the default does
    assert f["full"][0]["bytes"] == r["written_bytes"]
    assert f["crash_points"] == [2, 7, 12, 17, 22, 27, 32, 37]
    assert f["default"]["since"] == 2.0 and f["default"]["lag"] == 0.0 and f["ok"]  # only the head trains
    assert r["crashes"][0]["deviation"] == 0.0
    assert f["full_check"] == {"step": 40, "lag": 0.0}  # the newest full checkpoint: accepted, bit for bit
    assert r["cycles"]["restores"] == 5 and r["cycles"]["deviation"] == 0.0  # the head's state, exact each time
    table = policy.format_table([r], layerckpt.Config()) + "\n" + format_frontier([r])
    for column in ("raw", "written", "default lost (since+lag)", "est.lag", "frontier@bytes", "k8 ", "after 5"):
        assert column in table, column
    lossy = policy.run(WORKLOADS["frozen-backbone"], layerckpt.Config(encoding="lossy"), str(tmp_path / "lossy"),
                       crashes=(0.5,), steps=40, frontier=True)
    assert lossy["encoding"] == "lossy" and lossy["written_bytes"] < r["written_bytes"]
    # its frontier is the same lossless full checkpoints: bit for bit, the same bytes
    assert lossy["frontier"]["full_check"] == {"step": 40, "lag": 0.0}
    assert [p["bytes"] for p in lossy["frontier"]["full"]] == [p["bytes"] for p in f["full"]]
    assert lossy["cycles"]["restores"] == 5 and abs(lossy["cycles"]["deviation"]) < policy.CYCLES_TARGET
    row = policy.format_table([lossy], layerckpt.Config()).splitlines()[-1]
    assert row.split()[:2] == ["frozen-backbone", "lossy"] and "1% after 5" in row


def test_plot_is_written_where_matplotlib_is_installed(tmp_path):
    from layerckpt.bench.frontier import plot

    row = {"workload": "w", "frontier": {"full": [{"k": 1, "bytes": 400.0, "lost": 2.0}, {"k": 2, "bytes": 200.0,
                                                                                       "lost": 4.5}],
                                         "default": {"bytes": 300.0, "lost": 3.0}}}
    out = tmp_path / "frontier.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plot([row], str(out)) is None and not out.exists()
    else:
        assert plot([row], str(out)) == str(out) and out.stat().st_size > 0


def test_bench_cpu_splits_a_save_by_thread(tmp_path):
    """bench --cpu on the main job's model: each layerckpt checkpoint's CPU split by the thread that spent it."""
    from layerckpt.bench import cpu

    res = cpu.run(models=("main",), dirpath=str(tmp_path), contenders=("torch.save", "layerckpt full"), saves=6)
    runs = res["models"][0]["runs"]
    assert "parts_s" not in runs["torch.save"]  # one thread: nothing to split
    parts = runs["layerckpt full"]["parts_s"]
    assert {"call", "stager", "flusher", "other"} <= set(parts), parts
    # the background threads did the copies and the writes; save() on the caller took some of it too
    assert parts["stager"] > 0 and parts["flusher"] > 0 and parts["call"] > 0, parts
    assert sum(parts.values()) < 3 * runs["layerckpt full"]["cpu_s"]["max"], parts  # seconds, not nanoseconds
    table = cpu.format_table(res)
    assert "checkpoints timed per contender: 4 (after 2 untimed)" in table, table
    assert re.search(r"^  layerckpt full +call [0-9.]+  stager [0-9.]+  flusher [0-9.]+", table, re.M), table
    assert not list(tmp_path.iterdir())  # each contender's store removed
