"""DenseFormer (1x1 and k x p) through transformers' common suite and our generation tests."""

import unittest

from depthfusion_hf.models.configuration_denseformer import DenseFormerConfig
from depthfusion_hf.models.modeling_denseformer import DenseFormerForCausalLM, DenseFormerModel

from .generation_mixin import GenerationTesterMixin
from .testers import CausalLMModelTest, DecoderModelTester, Qwen3BackboneTester
from .upstream import load

modeling_common, configuration_common = load()


class DenseFormerModelTester(DecoderModelTester):
    config_class = DenseFormerConfig
    base_model_class = DenseFormerModel
    causal_lm_class = DenseFormerForCausalLM


class DenseFormerKxPModelTester(DenseFormerModelTester):
    family_options = {"dwa_dilation": 2, "dwa_period": 2}


class DenseFormerModelTest(CausalLMModelTest, modeling_common.ModelTesterMixin, GenerationTesterMixin,
                           unittest.TestCase):
    model_tester_class = DenseFormerModelTester
    config_tester_class = configuration_common.ConfigTester
    test_can_init_all_missing_weights_before_2023 = True


class DenseFormerKxPModelTest(DenseFormerModelTest):
    model_tester_class = DenseFormerKxPModelTester


class DenseFormerQwen3ModelTester(Qwen3BackboneTester, DenseFormerKxPModelTester):
    pass


class DenseFormerQwen3ModelTest(DenseFormerModelTest):
    model_tester_class = DenseFormerQwen3ModelTester
