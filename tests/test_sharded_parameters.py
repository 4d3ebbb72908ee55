"""FSDP2 (``fully_shard`` over a one-process gloo group, on CPU): every parameter of every causal family sharded
(DTensors, gathered only inside their layer's forward, as under tensor parallelism and DeepSpeed ZeRO-3), the
depth-fusion ones too (AttnRes's calls, mHC's odd-sized scale [3] and hc_scale [1], DenseFormer's DWA weights
outside the layers); each is read inside its layer, so the sharded model gives the plain model's logits, loss and
every gradient (float64), on every forward path of the family's entry in ``tests/family_cases.py``.
tests/training/test_fsdp.py runs the 2-process accelerate launch of every registered family."""

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.family_cases import CASES, params, tiny_model

EPS64 = torch.finfo(torch.float64).eps
CASES_AND_PATHS = [pytest.param(*p.values, setter, id=f"{p.id}-{path}") for p in params("sharding")
                   for path, setter in {"default": None, **CASES[p.values[0]].paths}.items()]


@pytest.fixture
def one_rank_group():
    """A one-process gloo group, so that FSDP2 can shard (over one rank) on CPU."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("family", "overrides", "path"), CASES_AND_PATHS)
def test_fsdp2_sharded_model_equals_the_plain_one(one_rank_group, monkeypatch, family, overrides, path):
    if path is not None:
        path(monkeypatch)
    plain = tiny_model(family, **overrides).double()
    sharded = type(plain)(plain.config).double()
    sharded.load_state_dict(plain.state_dict())
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())  # really sharded
    ids = torch.randint(0, plain.config.vocab_size, (2, 5))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            expected, got = plain(ids, labels=ids), sharded(ids, labels=ids)
        scale = expected.logits.abs().max().item()
        assert (got.logits - expected.logits).abs().max().item() <= 64 * EPS64 * scale
    got.loss.backward()
    expected.loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    for name, p in plain.named_parameters():
        scale = p.grad.abs().max().item() + 1e-30
        assert (grads[name] - p.grad).abs().max().item() <= 256 * EPS64 * scale, name
