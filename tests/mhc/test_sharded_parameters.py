"""FSDP2 (``fully_shard`` over a one-process gloo group, on CPU): every parameter sharded, the hyper-connections'
odd-sized ones (scale [3], hc_scale [1]) too; the sharded model gives the plain model's logits, loss and gradients
(float64). tests/training/test_fsdp.py runs the 2-process accelerate launch of every registered family."""

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from depthfusion_hf.models.modeling_mhc import MHCForCausalLM

from .helpers import EPS, randomise_mhc, tiny_config

EPS64 = EPS[torch.float64]


@pytest.fixture
def one_rank_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_sharded_model_equals_the_plain_one(one_rank_group):
    torch.manual_seed(0)
    plain = randomise_mhc(MHCForCausalLM(tiny_config())).double()
    sharded = MHCForCausalLM(plain.config).double()
    sharded.load_state_dict(plain.state_dict())
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
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
