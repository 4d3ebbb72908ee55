"""MoDA (FFN-side K/V on and off, post-norm) through transformers' common suite and our generation tests."""

import unittest

from depthfusion_hf.models.configuration_moda import MoDAConfig
from depthfusion_hf.models.modeling_moda import MoDAForCausalLM, MoDAModel

from .generation_mixin import GenerationTesterMixin
from .testers import CausalLMModelTest, DecoderModelTester, Qwen3BackboneTester
from .upstream import load

modeling_common, configuration_common = load()


class MoDAModelTester(DecoderModelTester):
    config_class = MoDAConfig
    base_model_class = MoDAModel
    causal_lm_class = MoDAForCausalLM


class MoDANoFFNKVModelTester(MoDAModelTester):
    family_options = {"moda_ffn_kv": False}


class MoDAPostNormModelTester(MoDAModelTester):
    family_options = {"norm_position": "post"}


class MoDAModelTest(CausalLMModelTest, modeling_common.ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    model_tester_class = MoDAModelTester
    config_tester_class = configuration_common.ConfigTester
    test_can_init_all_missing_weights_before_2023 = True

    def attention_key_length(self, config, layer_idx, kv_length):
        # By design a MoDA layer attends over the cached tokens and, per token, its depth entries: each earlier
        # layer's K/V, plus an FFN-side K/V pair per earlier layer with moda_ffn_kv (docs/MODA.md).
        return kv_length + layer_idx * (2 if config.moda_ffn_kv else 1)


class MoDANoFFNKVModelTest(MoDAModelTest):
    model_tester_class = MoDANoFFNKVModelTester


class MoDAPostNormModelTest(MoDAModelTest):
    model_tester_class = MoDAPostNormModelTester


class MoDAQwen3ModelTester(Qwen3BackboneTester, MoDAModelTester):
    pass


class MoDAQwen3ModelTest(MoDAModelTest):
    model_tester_class = MoDAQwen3ModelTester
