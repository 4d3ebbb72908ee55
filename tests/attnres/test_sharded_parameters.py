"""Sharded call parameters (FSDP2 here; tensor parallelism and DeepSpeed ZeRO-3 alike) cannot be read before their
layer runs, so the shared-source paths step aside and the per-call path gives the unsharded model's numbers."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from depthfusion_hf.models.attnres import AttnResForCausalLM
from depthfusion_hf.models.attnres.modeling_attnres import call_parameters, calls_readable_ahead

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
@pytest.mark.parametrize("small_numel", [None, -1])  # None: the decode buffer's sizes; -1: training's logit rows
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
    assert calls_readable_ahead(*call_parameters(plain.model.attnres_calls()), plain.config.hidden_size)
    assert not calls_readable_ahead(*call_parameters(sharded.model.attnres_calls()), plain.config.hidden_size)
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
