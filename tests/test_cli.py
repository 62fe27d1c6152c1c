"""layerckpt inspect / verify / export."""
import json
import subprocess
import sys

from safetensors.torch import load_file

import layerckpt
from conftest import assert_same_state, small_model, trained, stored_byte


def cli(*args):
    return subprocess.run([sys.executable, "-m", "layerckpt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_inspect_verify_export(tmp_path):
    model, opt = trained()
    root = tmp_path / "ck"
    with layerckpt.Checkpointer(root, model, opt, config=layerckpt.Config(keep_last=0)) as ck:
        ck.save(10).wait()
        ck.save(20).wait()
    r = cli("inspect", root)
    assert r.returncode == 0, r.stderr
    assert "step 20" in r.stdout and "h.3" in r.stdout and "committed steps: [10, 20]" in r.stdout

    r = cli("verify", root)
    assert r.returncode == 0 and "2 of 2 checkpoint(s) verified" in r.stdout

    out = tmp_path / "model.safetensors"
    r = cli("export", root, "--step", 10, "-o", out)
    assert r.returncode == 0, r.stderr
    fresh = small_model(7)
    fresh.load_state_dict(load_file(str(out)))
    assert_same_state(model, fresh)

    # damage a tensor of step 10 that step 20, a composite, still takes from step 10's file (a layer it carried):
    # verify names it and fails both
    m = json.loads((root / "manifests" / "step-00000010.json").read_text())
    m20 = json.loads((root / "manifests" / "step-00000020.json").read_text())
    carried = sorted(k for k, e in m20["tensors"].items() if k.startswith("model/") and k in m["tensors"]
                     and e["file"] == m["tensors"][k]["file"])
    assert carried, "step 20 carries no layer from step 10"
    e = m["tensors"][carried[0]]
    with open(root / "data" / e["file"], "r+b") as f:
        f.seek(stored_byte(e))
        f.write(b"\x13\x37")
    r = cli("verify", root)
    assert r.returncode == 1
    assert "FAIL step-00000010.json" in r.stdout and repr(carried[0]) in r.stdout
    assert "FAIL step-00000020.json" in r.stdout and "0 of 2 checkpoint(s) verified, 2 failed" in r.stdout


def test_cli_errors_are_one_line(tmp_path):
    r = cli("inspect", tmp_path / "missing")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
