"""FSDP2: sharded call parameters (DTensors, gathered only inside their layer's forward, as under tensor parallelism
and DeepSpeed ZeRO-3) are read by each call inside its layer, so the sharded model gives the unsharded model's
numbers: logits, loss and every gradient, in float64."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM

from .helpers import randomise_attnres, set_small_numel, tiny_config


@pytest.fixture
def one_rank_group():
    """A one-process gloo group, so that FSDP2 can shard (over one rank) on CPU."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("block_size", [None, 2])
@pytest.mark.parametrize("small_numel", [None, -1])  # None: the stacked forward of small inputs; -1: the list
def test_fsdp2_sharded_model_equals_the_plain_one(one_rank_group, monkeypatch, block_size, small_numel):
    if small_numel is not None:
        set_small_numel(monkeypatch, small_numel)
    torch.manual_seed(0)
    plain = AttnResForCausalLM(tiny_config(attnres_block_size=block_size)).double()
    randomise_attnres(plain)
    sharded = AttnResForCausalLM(plain.config).double()
    sharded.load_state_dict(plain.state_dict())
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert type(sharded.model.layers[0].mlp_res.query).__name__ == "DTensor"  # really sharded
    ids = torch.randint(0, plain.config.vocab_size, (2, 5))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            expected, got = plain(ids, labels=ids), sharded(ids, labels=ids)
        scale = expected.logits.abs().max().item()
        assert (got.logits - expected.logits).abs().max().item() <= 64 * torch.finfo(torch.float64).eps * scale
    got.loss.backward()
    expected.loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    for name, p in plain.named_parameters():
        scale = p.grad.abs().max().item() + 1e-30
        assert (grads[name] - p.grad).abs().max().item() <= 256 * torch.finfo(torch.float64).eps * scale, name
