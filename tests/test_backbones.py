"""Every causal family on every supported backbone (issue 30): the sub-layer split, upcycling bounds, a training step,
generation, saving and loading as remote code, and the errors for what does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

import depthfusion_hf
from depthfusion_hf import convert
from depthfusion_hf.models.backbones import (
    BACKBONES,
    attention_branch,
    branch_shape,
    layer_inputs,
    mlp_branch,
)
from depthfusion_hf.remote_code import save_remote_code_folder

from .fresh_process import run_fresh

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=101, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=64)


def backbone_config(model_type: str) -> AutoConfig:
    """A tiny config of each backbone, with its distinguishing features on (q/k norms, biases, sliding windows,
    per-layer attention types, Gemma 3's softcapping and scaled embeddings)."""
    return {
        "llama": lambda: LlamaConfig(**SIZES),
        "mistral": lambda: MistralConfig(sliding_window=5, **SIZES),
        "qwen2": lambda: Qwen2Config(**SIZES),
        "qwen3": lambda: Qwen3Config(head_dim=32, **SIZES),
        "phi3": lambda: Phi3Config(**SIZES),
        "olmo2": lambda: Olmo2Config(**SIZES),
        "gemma3_text": lambda: Gemma3TextConfig(
            head_dim=16, sliding_window=5, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], **SIZES),
    }[model_type]()


FAMILY_CONFIGS = {"denseformer": depthfusion_hf.DenseFormerConfig, "attnres": depthfusion_hf.AttnResConfig,
                  "mhc": depthfusion_hf.MHCConfig}
FAMILY_OPTIONS = {"denseformer": {"dwa_dilation": 2}, "attnres": {"attnres_block_size": 2}, "mhc": {"hc_mult": 2}}
PAIRS = [(family, backbone) for family in FAMILY_CONFIGS for backbone in BACKBONES]


def source_model(backbone: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(backbone_config(backbone)).eval()


def family_model(family: str, backbone: str, seed: int = 0):
    """``family`` (MoDA too: tests/moda/test_moda_backbones.py has its own cases) on a tiny ``backbone``."""
    torch.manual_seed(seed)
    config_class = FAMILY_CONFIGS.get(family, depthfusion_hf.MoDAConfig)
    config = config_class(backbone_config=backbone_config(backbone), **FAMILY_OPTIONS.get(family, {}))
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("backbone", BACKBONES)
def test_the_branches_reproduce_the_layer(backbone):
    """layer(x) = h + mlp_branch(h), h = x + attention_branch(x): bit for bit, for every layer shape."""
    source = source_model(backbone)
    decoder = source.model
    hidden = decoder.embed_tokens(torch.randint(3, 101, (2, 7)))
    position_ids = torch.arange(7)[None]
    per_layer = layer_inputs(decoder, hidden, None, None, position_ids)
    shape = branch_shape(depthfusion_hf.DenseFormerConfig(backbone_config=backbone_config(backbone)))
    with torch.no_grad():
        for layer, inputs in zip(decoder.layers, per_layer):
            expected = layer(hidden, position_ids=position_ids, **inputs)
            middle = hidden + attention_branch(layer, shape, hidden, position_ids=position_ids, **inputs)
            split = middle + mlp_branch(layer, shape, middle)
            assert torch.equal(split, expected)
            hidden = expected


# max |Δlogits| / max |logits| at conversion (docs/ARCHITECTURE.md, "Backbones"): DenseFormer exact; mHC the
# llama_to_mhc bound, 1e-5 on post-norm OLMo 2, whose sub-layers read rho^s times the residual with no norm to undo
# it (worst of 5 seeds here 5.2e-6); AttnRes is the source but for RMSNorm's eps, so it is compared with the eps near 0
# (5 seeds at eps 1e-6: up to 3.7e-2 relative on these tiny models, 3.6e-4 at real sizes); on OLMo 2, whose branches
# read the uniform average with no norm in front, the conversion scales their input projections by N instead
# (5 seeds: at most 5.4e-7 with the eps near 0; before that scaling, 0.27 at real sizes).
UPCYCLE_BOUNDS = {("denseformer", None): 0.0, ("mhc", None): 2e-6, ("mhc", "olmo2"): 1e-5, ("attnres", None): 1e-5}


@pytest.mark.parametrize("family,backbone", PAIRS)
def test_upcycling_keeps_the_source(family, backbone):
    source = source_model(backbone)
    if family == "attnres":
        source.config.rms_norm_eps = 1e-12
        for module in source.modules():
            for name in ("variance_epsilon", "eps"):
                if hasattr(module, name) and "Norm" in type(module).__name__:
                    setattr(module, name, 1e-12)
    model = depthfusion_hf.upcycle(source, family).eval()
    assert model.config.backbone_config is None if backbone == "llama" else \
        model.config.backbone_config.to_dict() == source.config.to_dict() | {"architectures": None}
    input_ids = torch.randint(3, 101, (2, 11))
    with torch.no_grad():
        expected, found = source(input_ids).logits, model(input_ids).logits
    relative = ((found - expected).abs().max() / expected.abs().max()).item()
    assert relative <= UPCYCLE_BOUNDS.get((family, backbone), UPCYCLE_BOUNDS[family, None]), relative


@pytest.mark.parametrize("family,backbone", PAIRS)
def test_a_pair_trains_and_generates_with_every_strategy(family, backbone):
    model = family_model(family, backbone).train()
    input_ids = torch.randint(3, 101, (2, 9))
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    own = [p for name, p in model.named_parameters() if name.split(".")[-1] in ("alphas", "query", "fn")]
    assert torch.isfinite(loss) and own and all(p.grad is not None and p.grad.abs().sum() > 0 for p in own)
    assert_cached_generation_equals_uncached(model.eval())


# generate()'s strategies, each run with and without the KV cache (sampling from the same seed).
STRATEGIES = {"greedy": dict(do_sample=False), "beam search": dict(do_sample=False, num_beams=2),
              "sampling": dict(do_sample=True, top_k=20)}


def assert_cached_generation_equals_uncached(model) -> torch.Tensor:
    """Greedy, beam search and sampling ``generate`` 8 tokens for a left-padded batch of two prompts, each giving the
    same ids with and without the KV cache; returns the greedy ids, [2, 12]."""
    prompt = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    found = {}
    for name, options in STRATEGIES.items():
        for use_cache in (True, False):
            torch.manual_seed(0)
            found[name, use_cache] = model.generate(prompt, attention_mask=mask, max_new_tokens=8, pad_token_id=0,
                                                    use_cache=use_cache, **options)
        assert torch.equal(found[name, True], found[name, False]), name
    return found["greedy", True]


def test_every_pair_loads_as_remote_code_with_identical_logits(tmp_path):
    """Saved as remote-code folders, every pair loads in a process without depthfusion_hf or Triton."""
    input_ids = [[5, 6, 7, 8, 9, 10, 11]]
    expected = {}
    for family, backbone in PAIRS:
        model = family_model(family, backbone)
        save_remote_code_folder(model, tmp_path / f"{family}-{backbone}")
        with torch.no_grad():
            expected[f"{family}-{backbone}"] = model(torch.tensor(input_ids)).logits
    out = run_fresh(f"""
        import json, pathlib, torch
        from transformers import AutoModelForCausalLM
        found = {{}}
        for folder in sorted(pathlib.Path({str(tmp_path)!r}).iterdir()):
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
            with torch.no_grad():
                found[folder.name] = model(torch.tensor({input_ids})).logits.tolist()
        print(json.dumps(found))
    """, cwd=str(tmp_path), hf_home=str(tmp_path / "hf_home"))
    found = json.loads(out.strip().splitlines()[-1])
    assert sorted(found) == sorted(expected)
    for name, logits in expected.items():
        assert torch.equal(torch.tensor(found[name]), logits), name


def test_an_unsupported_backbone_is_named():
    with pytest.raises(ValueError, match=r"model_type must be one of \['llama', 'mistral'.*got 'gpt2'"):
        depthfusion_hf.DenseFormerConfig(backbone_config=GPT2Config(n_layer=2))
    with pytest.raises(ValueError, match=r"must be one of \['llama', 'mistral', 'qwen2', 'qwen3'\]; got 'gemma3_text'"):
        depthfusion_hf.MoDAConfig(backbone_config=backbone_config("gemma3_text"))
    with pytest.raises(ValueError, match=r"model_type one of \['llama', 'mistral'.*GPT2LMHeadModel"):
        convert.load_source(AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2)))


def test_the_backbones_settings_that_serving_and_parallelism_read_are_the_familys():
    """vLLM's Transformers backend reads the logit caps at the config's top level (its own LM head and attention), and
    transformers' tensor parallelism the config's ``base_model_tp_plan``: a family on a backbone has the backbone's."""
    gemma = depthfusion_hf.MHCConfig(backbone_config=Gemma3TextConfig(final_logit_softcapping=30.0,
                                                                      attn_logit_softcapping=50.0, **SIZES))
    reloaded = depthfusion_hf.MHCConfig.from_dict(gemma.to_dict())
    for config in (gemma, reloaded):
        assert (config.final_logit_softcapping, config.attn_logit_softcapping) == (30.0, 50.0)
    assert depthfusion_hf.MHCConfig(**SIZES).base_model_tp_plan == LlamaConfig.base_model_tp_plan
    for backbone in ("phi3", "olmo2"):
        model = family_model("attnres", backbone)
        assert model.config.base_model_tp_plan == type(model.config.backbone_config).base_model_tp_plan
        layer_rules = {key: rule for key, rule in model.tp_plan.items() if key.startswith("model.layers.")}
        assert layer_rules == {f"model.{key}": rule for key, rule in model.config.base_model_tp_plan.items()}


def test_a_mismatched_backbone_config_is_named():
    with pytest.raises(ValueError, match=r"`hidden_size` is 128 but backbone_config.hidden_size is 64"):
        depthfusion_hf.AttnResConfig(hidden_size=128, backbone_config=backbone_config("qwen3"))
    config = depthfusion_hf.MHCConfig(backbone_config=backbone_config("qwen3"))
    config.backbone_config.num_hidden_layers = 2
    with pytest.raises(ValueError, match=r"`num_hidden_layers` is 3 but backbone_config.num_hidden_layers is 2"):
        AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"`dwa_dilation` must be .*at most num_hidden_layers"):
        depthfusion_hf.DenseFormerConfig(backbone_config=backbone_config("gemma3_text"), dwa_dilation=4)


LEGACY = Path(__file__).parent / "data" / "saved_before_backbones"  # saved by 2c95a89 (see its README.md)


@pytest.mark.parametrize("family", sorted(p.name for p in LEGACY.iterdir() if p.is_dir()))
def test_checkpoints_saved_before_backbones_load_unchanged(family):
    """Every family's checkpoint saved by the code before backbones existed loads with identical logits."""
    expected = json.loads((LEGACY / family / "expected_logits.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(LEGACY / family).eval()
    assert model.config.backbone_config is None
    with torch.no_grad():
        logits = model(torch.tensor(expected["input_ids"])).logits
    assert torch.equal(logits, torch.tensor(expected["logits"]))


@pytest.mark.parametrize("family", sorted(p.name for p in LEGACY.iterdir() if p.is_dir()))
def test_a_seeded_model_is_initialised_as_before_backbones(family):
    """``torch.manual_seed(0)`` then ``from_config`` gives the weights the code before backbones gave (the first 4
    values of every tensor, ``seeded_init.json``): the backbone's modules are initialised once, in the family's
    module order, so mHC's hyper-connections and MoDA's FFN K/V draw where they did."""
    expected = json.loads((LEGACY / family / "seeded_init.json").read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(LEGACY / family))
    weights = {name: tensor.flatten()[:4] for name, tensor in model.state_dict().items()}
    assert weights.keys() == expected.keys()
    for name, values in expected.items():
        assert torch.equal(weights[name], torch.tensor(values, dtype=weights[name].dtype)), name


NON_LLAMA = ("qwen3", "gemma3_text")  # q/k norms; sandwich norms, sliding + full layers, softcapping


@pytest.mark.parametrize("family,backbone", [(f, b) for f in FAMILY_CONFIGS for b in ("qwen3", "olmo2")])
def test_static_cache_decoding_compiles_on_another_backbone(family, backbone):
    """Compiled static-cache decoding equals eager dynamic-cache decoding, in one graph (test_compiled_decoding).
    Not on sliding-window backbones (Mistral with a window, Gemma 3): transformers' own MistralForCausalLM and
    Gemma3ForCausalLM recompile every step there (a guard on the sliding cache layer's length, transformers 5.25);
    their static cache is tested eagerly below."""
    from .test_compiled_decoding import assert_compiled_decoding_matches_eager

    assert assert_compiled_decoding_matches_eager(family_model(family, backbone)).graphs == 1


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_static_cache_decoding_on_sliding_window_layers(family):
    """Gemma 3 (two sliding-window layers of window 5, then a full one): the static cache's sliding layers give the
    dynamic cache's greedy tokens past the window."""
    model = family_model(family, "gemma3_text")
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 12, 13, 14, 15]])
    mask = (prompt != 0).long()
    runs = [model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                           cache_implementation=cache) for cache in ("dynamic", "static")]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("family,backbone", [(f, b) for f in FAMILY_CONFIGS for b in NON_LLAMA])
def test_gradient_checkpointing_and_lora_on_another_backbone(family, backbone):
    """Activation checkpointing gives the gradients of a plain backward; LoRA on the backbone's attention trains
    only the adapters (and the family's parameters the user names)."""
    from peft import LoraConfig, get_peft_model

    from depthfusion_hf.models.transformers_compat import enable_activation_checkpointing

    input_ids = torch.randint(3, 101, (2, 9))
    grads = []
    for checkpointing in (False, True):
        model = family_model(family, backbone).train()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        if checkpointing:
            enable_activation_checkpointing(model)
        model(input_ids, labels=input_ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    peft_model = get_peft_model(family_model(family, backbone), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    peft_model(input_ids, labels=input_ids).loss.backward()
    trained = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    assert all(p.grad is not None for name, p in peft_model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("family", [*FAMILY_CONFIGS, "moda"])
def test_resized_embeddings_save_and_load_on_another_backbone(family, tmp_path):
    """A top-level size set after construction (``resize_token_embeddings`` sets ``vocab_size``) is the backbone's
    too, so the model saves and loads with its new vocabulary."""
    model = family_model(family, "qwen3")
    model.resize_token_embeddings(120)
    assert model.config.vocab_size == model.config.backbone_config.vocab_size == 120
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.tensor([[5, 6, 119]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)
