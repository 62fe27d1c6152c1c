"""What the Accelerate test modules share: a clean accelerate state per test, Runs closed after it, and
one comparison of saved states.  Import the fixtures into a test module to use them."""
import pytest
from accelerate.state import AcceleratorState, GradientState

from accelerate_helpers import Run
from conftest import assert_same_optimizer_state, assert_same_tensors


@pytest.fixture(autouse=True)
def fresh_accelerate(monkeypatch):
    monkeypatch.delenv("LAYERCKPT_ENABLED", raising=False)
    monkeypatch.delenv("LAYERCKPT_CONFIG", raising=False)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def runs():
    made = []

    def make(*args, **kwargs) -> Run:
        made.append(Run(*args, **kwargs))
        return made[-1]

    yield make
    for r in made:
        if r.plugin is not None and r.plugin.accelerator is not None:
            r.plugin.close()


def same_state(a: dict, b: dict) -> None:
    assert_same_tensors(a["model"], b["model"])
    assert_same_optimizer_state(a["optim"], b["optim"])
