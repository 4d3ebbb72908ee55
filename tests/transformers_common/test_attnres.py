"""AttnRes (full and block) through transformers' common suite and our generation tests."""

import unittest

from depthfusion_hf.models.configuration_attnres import AttnResConfig
from depthfusion_hf.models.modeling_attnres import AttnResForCausalLM, AttnResModel

from .generation_mixin import GenerationTesterMixin
from .testers import CausalLMModelTest, DecoderModelTester, Qwen3BackboneTester
from .upstream import load

modeling_common, configuration_common = load()


class AttnResModelTester(DecoderModelTester):
    config_class = AttnResConfig
    base_model_class = AttnResModel
    causal_lm_class = AttnResForCausalLM


class AttnResBlockModelTester(AttnResModelTester):
    # 2 layers = 4 sub-layers in blocks of 3: a full block and a shorter last one.
    family_options = {"attnres_block_size": 3}


class AttnResModelTest(CausalLMModelTest, modeling_common.ModelTesterMixin, GenerationTesterMixin,
                       unittest.TestCase):
    model_tester_class = AttnResModelTester
    config_tester_class = configuration_common.ConfigTester
    test_can_init_all_missing_weights_before_2023 = True


class AttnResBlockModelTest(AttnResModelTest):
    model_tester_class = AttnResBlockModelTester


class AttnResQwen3ModelTester(Qwen3BackboneTester, AttnResBlockModelTester):
    pass


class AttnResQwen3ModelTest(AttnResModelTest):
    model_tester_class = AttnResQwen3ModelTester
