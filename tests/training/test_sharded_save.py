"""The recipe's FSDP / DeepSpeed save path, driven by a stand-in Trainer (neither runs on CPU).

Under FSDP or DeepSpeed ZeRO-3 the in-memory parameters are shards, so ``train_one`` saves an unsharded
copy built from ``accelerator.get_state_dict`` (gathered on rank 0). The gather itself is accelerate's;
this checks what the recipe does with its result.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from depthfusion_hf.recipes.clm import unsharded_model

from .builders import tiny_denseformer, tiny_moda, token_batch


def fake_trainer(model, state_dict, rank: int = 0, fsdp: bool = True):
    """What ``unsharded_model`` reads from a ``Trainer``."""
    return SimpleNamespace(
        is_fsdp_enabled=fsdp, is_deepspeed_enabled=False, model_wrapped=model,
        accelerator=SimpleNamespace(get_state_dict=lambda wrapped: state_dict),
        is_world_process_zero=lambda: rank == 0,
    )


@pytest.mark.parametrize("build", [tiny_denseformer, tiny_moda])
def test_gathered_state_becomes_an_identical_unsharded_copy(build):
    model = build(tie_word_embeddings=True)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    copy = unsharded_model(fake_trainer(model, state), model)
    assert copy is not model and type(copy) is type(model)
    assert copy.lm_head.weight.data_ptr() == copy.model.embed_tokens.weight.data_ptr()  # re-tied
    ids = token_batch(100)
    with torch.no_grad():
        torch.testing.assert_close(copy.eval()(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    assert unsharded_model(fake_trainer(model, state, rank=1), model) is None  # other ranks only join the gather


def test_unsharded_training_saves_the_model_itself_and_bad_states_fail():
    model = tiny_denseformer()
    assert unsharded_model(fake_trainer(model, None, fsdp=False), model) is model
    state = model.state_dict()
    state.pop("model.dwa.alphas")
    with pytest.raises(RuntimeError, match="missing"):
        unsharded_model(fake_trainer(model, state), model)

