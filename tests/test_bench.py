"""`layerckpt bench` runs end to end (tiny preset: a smoke test, not a measurement)."""
import json
import subprocess
import sys


def test_bench_tiny_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "bench", "--preset", "tiny", "--reps", "2",
                        "--dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert set(res["runs"]) == {"layerckpt", "torch.save", "safetensors", "dcp"}
    lc = res["runs"]["layerckpt"]
    assert lc["restore_bit_exact"] and lc["bytes"] >= res["state_bytes"]
    rows = res["selective"]
    assert rows[0]["blocks_moved"] == 0 and rows[-1]["blocks_moved"] == 4
    assert [r["bytes"] for r in rows] == sorted(r["bytes"] for r in rows) and rows[0]["bytes"] < rows[-1]["bytes"]
    for key in ("durable_vs_odirect_write", "stall_vs_memcpy", "restore_vs_odirect_read", "dcp_durable_over_ours"):
        assert res["ratios"][key] > 0
    assert res["disk"]["write_s"] > 0 and res["memcpy_s"] > 0
    assert res["tiers"]["restore_bit_exact"] and res["tiers"]["restore_memory_s"] > 0  # memory vs disk vs remote
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself


def test_bench_restore_tiny_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "layerckpt.cli", "bench", "--restore", "--sizes", "2MB", "--reps", "1",
                        "--cache", "warm", "--dir", str(tmp_path), "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["sizes"]
    assert set(row["seconds"]["warm"]) == {"layerckpt", "torch.load", "dcp.load"}
    assert all(len(ts) == 1 and ts[0] > 0 for ts in row["seconds"]["warm"].values())
    assert row["bit_exact"]["layerckpt"] is True and row["ratios"]["warm"]["torch.load/ours"] > 0
    assert not list(tmp_path.iterdir())  # the bench cleans up after itself
