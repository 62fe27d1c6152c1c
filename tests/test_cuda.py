"""The CUDA paths (staging from device memory on a side stream into pinned buffers, lazy staging ordered
after the caller's stream, restore into device tensors): run where a GPU is present, skipped elsewhere."""
import pytest
import torch

import layerckpt
from conftest import assert_same_optimizer_state, assert_same_tensors, small_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _trained(seed=0, steps=2):
    model = small_model(seed).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), device="cuda", generator=g)
        opt.zero_grad()
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
    return model, opt


def _cpu(sd):
    return {k: v.detach().cpu() for k, v in sd.items()}


@pytest.mark.parametrize("lazy", [True, False])
def test_cuda_state_saves_and_restores_bit_for_bit(tmp_path, lazy):
    model, opt = _trained()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # training on a stream of its own: the copies must follow it
        want = _cpu(model.state_dict())
        want_opt = opt.state_dict()
        want_opt = {"state": {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                              for i, s in want_opt["state"].items()}, "param_groups": want_opt["param_groups"]}
        with layerckpt.Checkpointer(str(tmp_path), model, opt,
                                    layerckpt.Config(threshold=0.0, lazy_staging=lazy)) as ck:
            ck.save(1)
            x = torch.randint(0, 64, (4, 16), device="cuda")

            def closure():
                opt.zero_grad()
                loss = model(x).float().logsumexp(-1).mean()
                loss.backward()
                return loss

            opt.step(closure)  # waits for the copies (lazy), then changes every weight
    torch.cuda.synchronize()
    model2, opt2 = _trained(seed=1, steps=1)
    layerckpt.restore(str(tmp_path), model2, opt2)
    assert_same_tensors(_cpu(model2.state_dict()), want)
    got = opt2.state_dict()
    got = {"state": {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                     for i, s in got["state"].items()}, "param_groups": got["param_groups"]}
    assert_same_optimizer_state(got, want_opt)
    loaded = layerckpt.read_checkpoint(str(tmp_path))
    assert_same_tensors({k: loaded.model[k] for k in want}, want)
