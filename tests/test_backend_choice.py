"""Which implementation runs, for every op and every decoder family: the one rule of
``depthfusion_common.resolve_backend`` (argument > ``$DEPTHFUSION_BACKEND`` > the config's ``op_backend`` >
automatic), its errors, and the models resolving once per forward and device through ``backend_per_device``.

Op-specific routing of work the kernels do not compute (float64, too many streams, D past the kernels' limit) is
tested with each op's Triton tests."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from depthfusion_hf.models import attnres, depthfusion_common, dwa, mhc_connection, mhc_mix, moda_attention
from depthfusion_hf.models.depthfusion_common import BACKEND_ENV_VAR

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Op:
    """One public op: the module whose ``resolve_backend`` it calls, the module and name of its reference
    implementation (spied on), and a call on tiny inputs with a given ``backend``."""

    resolver: ModuleType
    reference_module: ModuleType
    reference_name: str
    call: Callable[[str | None], object]
    kernel_name: str  # the kernel entry the op module imports (None there when the kernel module did not import)


def _streams(n=2, dim=3):
    return torch.randn(1, 2, n, dim)


OPS = {
    "depth_weighted_average": Op(dwa, dwa, "dwa_reference", lambda backend: dwa.depth_weighted_average(
        [torch.randn(4), torch.randn(4)], torch.randn(2), backend=backend), "triton_depth_weighted_average"),
    "attention_residual": Op(attnres, attnres, "attnres_reference", lambda backend: attnres.attention_residual(
        torch.randn(4), [torch.randn(1, 2, 4), torch.randn(1, 2, 4)], torch.ones(4), backend=backend),
        "triton_attention_residual"),
    "hyper_connection": Op(mhc_connection, mhc_connection, "hyper_connection_reference",
                           lambda backend: mhc_connection.hyper_connection(
                               _streams(), torch.randn(8, 6), torch.zeros(8), torch.ones(3), sinkhorn_iters=2,
                               eps=1e-6, norm_eps=1e-6, backend=backend), "triton_hyper_connection"),
    "hyper_head": Op(mhc_connection, mhc_connection, "hyper_head_reference",
                     lambda backend: mhc_connection.hyper_head(
                         _streams(), torch.randn(2, 6), torch.zeros(2), torch.ones(1), eps=1e-6, norm_eps=1e-6,
                         backend=backend), "triton_hyper_connection"),
    "hyper_mix": Op(mhc_connection, mhc_mix, "hyper_mix_reference", lambda backend: mhc_mix.hyper_mix(
        _streams(), torch.randn(1, 2, 3), torch.rand(1, 2, 2), torch.rand(1, 2, 2, 2), backend=backend),
        "triton_hyper_connection"),
    "moda_attention": Op(moda_attention, moda_attention, "moda_reference",
                         lambda backend: moda_attention.moda_attention(
                             torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4),
                             torch.randn(1, 1, 3, 2, 4), torch.randn(1, 1, 3, 2, 4), backend=backend),
                         "triton_moda_forward"),
}
RESOLVERS = {name: op.resolver.resolve_backend for name, op in OPS.items()}


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)


def fake_triton(monkeypatch, available: bool, runs_on: Callable[[torch.device], bool] = lambda device: True):
    """Pretend Triton can (or cannot) run, and where, for every op."""
    monkeypatch.setattr(depthfusion_common, "triton_available", lambda: available)
    monkeypatch.setattr(depthfusion_common, "triton_runs_on", lambda device: available and runs_on(device))


def spy(monkeypatch, op: Op) -> list[str]:
    """Record the op's reference calls."""
    calls: list[str] = []
    original = getattr(op.reference_module, op.reference_name)
    monkeypatch.setattr(op.reference_module, op.reference_name,
                        lambda *args: calls.append("reference") or original(*args))
    return calls


@pytest.mark.parametrize("name", sorted(OPS))
def test_precedence_argument_environment_config_automatic(name, monkeypatch):
    resolve = RESOLVERS[name]
    assert resolve(None, CPU) == "torch"
    assert resolve("auto", CPU) == resolve("AUTO", CPU) == "torch"
    assert resolve("Reference", CPU) == "reference"
    assert resolve(None, CPU, "reference") == "reference"  # the config's op_backend
    assert resolve(None, CPU, "auto") == "torch"
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    assert resolve(None, CPU, "reference") == "torch"  # the environment over the config
    assert resolve("reference", CPU, "torch") == "reference"  # the argument over both


@pytest.mark.parametrize("name", sorted(OPS))
def test_the_op_runs_the_chosen_implementation(name, monkeypatch):
    op = OPS[name]
    calls = spy(monkeypatch, op)
    op.call("reference")
    assert calls == ["reference"]
    op.call("torch")
    op.call(None)
    assert calls == ["reference"]
    monkeypatch.setenv(BACKEND_ENV_VAR, "reference")
    op.call(None)
    assert calls == ["reference", "reference"]
    op.call("torch")  # an explicit argument wins over the environment
    assert calls == ["reference", "reference"]


@pytest.mark.parametrize("name", sorted(OPS))
def test_automatic_picks_triton_for_cuda_tensors_only_where_it_runs(name, monkeypatch):
    resolve = RESOLVERS[name]
    fake_triton(monkeypatch, True)
    assert resolve(None, torch.device("cuda")) == "triton"
    assert resolve(None, CPU) == "torch"  # even where the kernels run on CPU (interpreted)
    monkeypatch.setattr(OPS[name].resolver, OPS[name].kernel_name, None)  # the kernel module did not import
    assert resolve(None, torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="backend='triton' was requested but Triton"):
        resolve("triton", torch.device("cuda"))
    fake_triton(monkeypatch, False)
    assert resolve(None, torch.device("cuda")) == "torch"


@pytest.mark.parametrize("name", sorted(OPS))
def test_triton_where_it_cannot_run_names_the_reason(name, monkeypatch):
    op = OPS[name]
    fake_triton(monkeypatch, False)
    with pytest.raises(ValueError, match="backend='triton' was requested but Triton"):
        op.call("triton")
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    with pytest.raises(ValueError, match="not available"):
        op.call(None)
    fake_triton(monkeypatch, True, runs_on=lambda device: device.type == "cuda")  # a CUDA machine, CPU tensors
    with pytest.raises(ValueError, match="runs on CUDA tensors.*got device cpu"):
        op.call(None)
    monkeypatch.delenv(BACKEND_ENV_VAR)
    assert RESOLVERS[name](None, CPU) == "torch"


@pytest.mark.parametrize("name", sorted(OPS))
def test_an_unknown_backend_names_the_allowed_values(name, monkeypatch):
    op = OPS[name]
    with pytest.raises(ValueError) as error:
        op.call("cuda")
    for allowed in ("auto", "reference", "torch", "triton", "'cuda'"):
        assert allowed in str(error.value)
    with pytest.raises(ValueError, match="backend must be one of .* or None; got 3"):
        RESOLVERS[name](3, CPU)
    monkeypatch.setenv(BACKEND_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="'fast'"):
        op.call(None)


@pytest.mark.parametrize("name", sorted(OPS))
def test_an_automatic_choice_is_logged_at_debug_and_an_explicit_one_is_not(name, caplog):
    resolver = OPS[name].resolver
    with caplog.at_level(logging.DEBUG, logger=depthfusion_common.__name__):
        resolver.resolve_backend("torch", CPU)
        assert caplog.text == ""
        resolver.resolve_backend(None, CPU)
    assert f"{resolver.__name__}: backend 'torch' on cpu" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="Triton genuinely runs here")
def test_triton_is_unavailable_on_a_cpu_machine_without_the_interpreter():
    assert depthfusion_common.triton_available() is False
    for op in OPS.values():
        with pytest.raises(ValueError, match="not available"):
            op.call("triton")


@pytest.mark.integration
def test_every_op_works_without_triton_installed(tmp_path):
    """With Triton unimportable, the kernel modules still import, Triton reports unavailable and every op runs."""
    code = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError("No module named 'triton' (blocked by the test)")
sys.meta_path.insert(0, _Block())
import torch
from depthfusion_hf.models import depthfusion_common, dwa, dwa_triton, attnres_triton, mhc_triton
from tests.test_backend_choice import OPS
assert dwa_triton.triton is None and attnres_triton.triton is None and mhc_triton.triton is None
assert not depthfusion_common.triton_available()
y = dwa.depth_weighted_average([torch.ones(3), 2 * torch.ones(3)], torch.tensor([1.0, 0.5]))
assert torch.equal(y, 2 * torch.ones(3)), y
for name, op in OPS.items():
    op.call(None)
    try:
        op.call("triton")
    except ValueError as e:
        assert "not available" in str(e), (name, e)
    else:
        raise AssertionError(f"{name}: no ValueError")
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", BACKEND_ENV_VAR)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


# ---------------------------------------------------------------- models

TINY = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=20)


def decoder_families():
    from depthfusion_hf import AttnResConfig, DenseFormerConfig, MHCConfig, MoDAConfig
    from depthfusion_hf.models import modeling_attnres, modeling_denseformer, modeling_mhc, modeling_moda

    return {"denseformer": (DenseFormerConfig, modeling_denseformer, dwa),
            "moda": (MoDAConfig, modeling_moda, moda_attention),
            "attnres": (AttnResConfig, modeling_attnres, attnres),
            "mhc": (MHCConfig, modeling_mhc, mhc_connection)}


@pytest.mark.parametrize("family", ["denseformer", "moda", "attnres", "mhc"])
def test_a_model_resolves_its_ops_backend_once_per_forward_from_its_config(family, monkeypatch):
    """Every family follows one rule: the model resolves (argument None, the config's op_backend) once per forward
    and device, and the ops run that backend; $DEPTHFUSION_BACKEND overrides the config; a bad name is an error."""
    from transformers import AutoModelForCausalLM

    config_class, _, _ = decoder_families()[family]
    chosen: list[tuple] = []
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(**TINY, op_backend="reference")).eval()
    base_model = type(model.model)  # its forward (causal_lm.DepthFusionModel) resolves with the family op's rule
    original = base_model.resolve_backend
    monkeypatch.setattr(base_model, "resolve_backend",
                        staticmethod(lambda *args: chosen.append(args) or original(*args)))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        reference = model(ids).logits
        assert chosen == [(None, CPU, "reference")]
        model.config.op_backend = "torch"
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)
        assert chosen[1:] == [(None, CPU, "torch")]
        monkeypatch.setenv(BACKEND_ENV_VAR, "gpu-please")
        with pytest.raises(ValueError, match="backend must be one of"):
            model(ids)


def test_a_denseformer_runs_every_dwa_step_on_the_configs_backend(monkeypatch):
    """The model calls the op's core with the backend it resolved: op_backend='reference' reaches the reference."""
    from depthfusion_hf import DenseFormerConfig, DenseFormerForCausalLM

    calls = spy(monkeypatch, OPS["depth_weighted_average"])
    config = DenseFormerConfig(**TINY, op_backend="reference")
    DenseFormerForCausalLM(config)(torch.tensor([[1, 2, 3]]))
    assert calls == ["reference", "reference"]
    config.op_backend = "torch"
    calls.clear()
    DenseFormerForCausalLM(config)(torch.tensor([[1, 2, 3]]))
    assert calls == []
