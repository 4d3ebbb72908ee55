"""The control: transformers' Llama through the same common suite and generation tests, at our families' shapes."""

import unittest

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from .generation_mixin import GenerationTesterMixin
from .testers import CausalLMModelTest, DecoderModelTester
from .upstream import load

modeling_common, configuration_common = load()


class LlamaModelTester(DecoderModelTester):
    config_class = LlamaConfig
    base_model_class = LlamaModel
    causal_lm_class = LlamaForCausalLM


class LlamaModelTest(CausalLMModelTest, modeling_common.ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    model_tester_class = LlamaModelTester
    config_tester_class = configuration_common.ConfigTester
    test_can_init_all_missing_weights_before_2023 = True
