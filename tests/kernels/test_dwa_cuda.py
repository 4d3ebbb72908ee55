"""The Triton DWA on CUDA only: a second device, the current stream, CUDA-graph capture, dynamo tracing.

The launches take the sources as kernel arguments and build nothing on the host, so a captured graph replays them
and dynamo traces them; they run under the tensors' device. Skipped without a GPU (the interpreter has no
devices, streams or graphs); ``scripts/gpu_check.sh`` runs them on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from depthfusion_hf.models.dwa import depth_weighted_average  # noqa: E402
from tests.kernels._dwa_cases import assert_matches_reference, make_inputs  # noqa: E402

DEVICE = "cuda"

@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_another_device_than_the_current_one():
    """Triton launches on the current device: the op must make the tensors' device current (device_map="auto")."""
    with torch.cuda.device(0):
        sources, weights = make_inputs(3, (4, 1000), torch.bfloat16, "cuda:1")
        y = depth_weighted_average(sources, weights, backend="triton")
        grad_out = torch.randn(4, 1000, device="cuda:1", dtype=torch.bfloat16)
        grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    assert_matches_reference(y, grads, sources, weights, grad_out)


def test_runs_on_the_current_stream_and_in_a_cuda_graph():
    """No host work per call: a side stream gives the same numbers, and the forward and backward replay from a
    captured CUDA graph."""
    sources, weights = make_inputs(20, (8, 1000), torch.bfloat16, DEVICE)
    grad_out = torch.randn(8, 1000, device=DEVICE, dtype=torch.bfloat16)
    eager_y = depth_weighted_average(sources, weights, backend="triton")
    eager_grads = torch.autograd.grad(eager_y, [weights, *sources], grad_out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (compilation) off the capture, as torch.cuda.graph requires
            y = depth_weighted_average(sources, weights, backend="triton")
            torch.autograd.grad(y, [weights, *sources], grad_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = depth_weighted_average(sources, weights, backend="triton")
        grads = torch.autograd.grad(y, [weights, *sources], grad_out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager_y)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)


def test_dynamo_traces_the_launches_without_graph_breaks():
    sources, weights = make_inputs(5, (8, 1000), torch.bfloat16, DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(lambda s, w: depth_weighted_average(s, w, backend="triton"), fullgraph=True)
    y = compiled(sources, weights)
    torch.testing.assert_close(y, depth_weighted_average(sources, weights, backend="triton"), rtol=0, atol=0)
