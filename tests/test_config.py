"""Config: contradictions refused by name, the full mode's two spellings, every way a Config is built."""
import dataclasses
import json
import pickle

import pytest
import yaml

import layerckpt
from layerckpt import Config, ConfigError
from layerckpt.config import FIDELITY, GROUPS

from conftest import small_model


# ------------------------------------------------------------------ contradictions

@pytest.mark.parametrize("kw, says", [
    ({"threshold": 0.1, "fidelity": 0.01},
     r"Config.threshold=0.1 and Config.fidelity=0.01 are two selection rules.*drop fidelity.*or drop threshold"),
    ({"threshold": 0.1, "fidelity": FIDELITY},  # the default's value, but given: still two rules
     r"Config.threshold=0.1 and Config.fidelity=0.004 are two selection rules"),
    ({"threshold": 0.0, "fidelity": 0.01},
     r"Config.threshold=0.0 \(full checkpoints\) and Config.fidelity=0.01 are two selection rules"),
    ({"full": True, "fidelity": 0.01},
     r"Config.full=True writes every layer at every save, but Config.fidelity=0.01 .*; drop fidelity \(or full\)"),
    ({"full": True, "threshold": 0.2},
     r"Config.full=True .* but Config.threshold=0.2 would select layers by drift; drop threshold \(or full\)"),
    ({"full": True, "budget_bytes": "1MiB"},
     r"Config.full=True .* but Config.budget_bytes=1048576 would cap .*; drop budget_bytes \(or full\)"),
    ({"remote_every": 3},
     r"Config.remote_every=3 says which composites go to the remote tier, but Config.remote is not set; "
     r"set remote .* or drop remote_every"),
    ({"remote_every": "base", "base_every": 2}, r"Config.remote_every='base' .* Config.remote is not set"),
    ({"remote_options": {"key": "k"}}, r"Config.remote_options is set but Config.remote is not"),
    ({"remote_bandwidth": "1MB"}, r"Config.remote_bandwidth caps uploads .* Config.remote is not set"),
    ({"remote": "memory://b/x", "remote_every": "base"}, r"with base_every=0 only the first save is one"),
    ({"full": "yes"}, r"Config.full must be true or false, got 'yes'"),
])
def test_contradictions_are_refused_naming_the_field_to_drop(kw, says):
    with pytest.raises(ConfigError, match=says) as e:
        Config(**kw)
    assert isinstance(e.value, ValueError)


def test_what_does_not_contradict_is_accepted():
    assert Config(threshold=0.1).threshold == 0.1 and Config(fidelity=0.01).fidelity == 0.01
    assert Config(threshold=0.01, budget_bytes="2MiB").budget_bytes == 2 << 20
    assert Config(fidelity=0.01, budget_bytes=100).budget_bytes == 100
    assert Config(full=True, threshold=0.0).full  # the same thing said twice
    assert Config(full=True, remote="memory://b/x", remote_every="base").remote_every == "base"
    assert Config(remote="memory://b/x", remote_every=2).remote_every == 2


def test_default_fidelity_reads_as_a_plain_number():
    c = Config()
    assert c.fidelity == 0.004 and isinstance(c.fidelity, float) and Config.fidelity == 0.004
    assert json.loads(json.dumps(c.recorded()))["fidelity"] == 0.004
    assert yaml.safe_load(yaml.safe_dump(c.to_dict()))["fidelity"] == 0.004
    assert type(c.to_dict()["fidelity"]) is float and type(c.recorded()["fidelity"]) is float
    # a default carried through a copy is still not a choice: a threshold may replace it
    for copy in (pickle.loads(pickle.dumps(c)), dataclasses.replace(c), c.replace(), Config.from_dict(c.to_dict())):
        assert copy.replace(threshold=0.3).threshold == 0.3


def test_replace_keeps_refusing_a_second_rule():
    with pytest.raises(ConfigError, match="two selection rules"):
        Config(threshold=0.1).replace(fidelity=0.02)
    with pytest.raises(ConfigError, match="two selection rules"):
        Config(fidelity=0.02).replace(threshold=0.1)
    with pytest.raises(ConfigError, match=r"drop fidelity \(or full\)"):
        Config(full=True).replace(fidelity=0.02)


# ------------------------------------------------------------------ the full mode

def test_both_full_spellings_give_one_config_and_one_record():
    a, b = Config(full=True), Config(threshold=0.0)
    assert a == b and a.recorded() == b.recorded() and a.to_dict() == b.to_dict()
    assert a.full and a.threshold == 0.0 and a.fidelity == FIDELITY and a.budget_bytes is None
    assert Config(full=True, keep_last=0) == Config(threshold=0.0, keep_last=0)
    capped = Config(threshold=0.0, budget_bytes=100)  # every moved layer up to a cap: not full
    assert not capped.full and capped.threshold == 0.0
    assert not Config().full and not Config(threshold=0.1).full and not Config(fidelity=0.0).full


def test_replace_moves_between_the_modes():
    full = Config(full=True)
    back = full.replace(full=False)
    assert not back.full and back.threshold is None and back == Config()
    drift = full.replace(threshold=0.2)
    assert not drift.full and drift == Config(threshold=0.2)
    assert full.replace(threshold=0.0) == full and full.replace(keep_last=0).full
    capped = full.replace(budget_bytes=100)
    assert capped == Config(threshold=0.0, budget_bytes=100) and not capped.full
    assert Config().replace(threshold=0.0) == full and Config().replace(full=True) == full
    with pytest.raises(ConfigError, match=r"Config.threshold=0.2 would select layers by drift"):
        Config(threshold=0.2).replace(full=True)


def _save_twice(root, cfg):
    """Two saves of an unchanged model: a full one writes every layer both times."""
    with layerckpt.Checkpointer(root, small_model(), config=cfg) as ck:
        ck.save(1).wait()
        second = ck.save(2)
        second.wait()
    with open(second.manifest_path) as f:
        return second, json.load(f)


def test_both_full_spellings_save_alike(tmp_path):
    p_full, m_full = _save_twice(str(tmp_path / "a"), Config(full=True, keep_last=0))
    p_zero, m_zero = _save_twice(str(tmp_path / "b"), Config(threshold=0.0, keep_last=0))
    assert p_full.layers_persisted == p_full.layers_total == p_zero.layers_persisted == p_zero.layers_total
    assert m_full["config"] == m_zero["config"] and m_full["config"]["full"] is True
    assert {e["reason"] for e in m_full["layers"].values()} == {"full"}
    assert {e["reason"] for e in m_zero["layers"].values()} == {"full"}


# ------------------------------------------------------------------ every way in

def test_flat_keyword_arguments():
    c = Config(threshold=0.05, max_staleness=7, base_every=4, keep_last=3)
    assert (c.threshold, c.max_staleness, c.base_every, c.keep_last, c.full) == (0.05, 7, 4, 3, False)


def test_yaml_spellings(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("layerckpt:\n  full: true\n  keep_last: 4\n")
    assert Config.from_yaml(y) == Config(full=True, keep_last=4)
    y.write_text("threshold: 0.0\nkeep_last: 4\n")
    assert Config.from_yaml(y) == Config(full=True, keep_last=4)
    y.write_text("threshold: 0.1\nfidelity: 0.02\n")
    with pytest.raises(ConfigError, match="two selection rules"):
        Config.from_yaml(y)


def test_old_recorded_configs_still_load():
    """A manifest written before ``full`` existed records fidelity 0.004 beside threshold 0.0."""
    old = {k: v for k, v in Config().recorded().items() if k != "full"}
    full = Config.from_dict(json.loads(json.dumps({**old, "threshold": 0.0})))
    assert full == Config(full=True) and full.recorded() == Config(threshold=0.0).recorded()
    drift = Config.from_dict(json.loads(json.dumps({**old, "threshold": 0.05})))
    assert drift == Config(threshold=0.05) and not drift.full
    assert Config.from_dict(old) == Config()
    for c in (Config(), Config(full=True), Config(threshold=0.2, keep_last=0), Config(fidelity=0.01)):
        assert Config.from_dict(c.to_dict()) == c
        assert Config.from_dict(json.loads(json.dumps(c.recorded()))) == c


def test_groups_list_every_field_once():
    listed = [name for names in GROUPS.values() for name in names]
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(Config))
    assert len(listed) == len(set(listed))
    assert set(GROUPS) == {"selection", "io", "tiers", "restore", "preemption"}


def test_moved_names_stay_importable():
    from layerckpt.tiers import _remote
    from layerckpt.io import _units
    from layerckpt import _url, config

    assert config.parse_size is _units.parse_size and config.ALIGN == _units.ALIGN == 4096
    assert (config.KiB, config.MiB, config.GiB) == (1 << 10, 1 << 20, 1 << 30)
    assert _remote.is_url is _url.is_url and _remote.check_config is _url.check_config
    assert config.parse_size("16MiB", "chunk_bytes") == 16 << 20


def test_lightning_arguments_meet_the_same_checks(tmp_path):
    import lightning  # noqa: F401
    from lightning_layerckpt import LayerCheckpoint

    with pytest.raises(ConfigError, match="two selection rules"):
        LayerCheckpoint(threshold=0.1, fidelity=0.01)
    y = tmp_path / "c.yaml"
    y.write_text("threshold: 0.0\n")
    with pytest.raises(ConfigError, match=r"drop fidelity \(or full\)"):
        LayerCheckpoint(config=str(y), fidelity=0.01)
    assert LayerCheckpoint(config=str(y), threshold=0.1).layer_config == Config(threshold=0.1)
