"""mHC (n = 4 and n = 1 streams) through transformers' common suite and our generation tests, once the family is in
the registry (``depthfusion_hf.families.FAMILIES``)."""

import unittest

import pytest
import torch

from depthfusion_hf.families import FAMILIES

if "mhc" not in FAMILIES:
    pytest.skip("the mHC family is not registered in depthfusion_hf.families yet (issue 22)", allow_module_level=True)

from depthfusion_hf.models.configuration_mhc import MHCConfig  # noqa: E402
from depthfusion_hf.models.modeling_mhc import MHCForCausalLM, MHCModel

from .generation_mixin import GenerationTesterMixin  # noqa: E402
from .testers import CausalLMModelTest, DecoderModelTester, Qwen3BackboneTester  # noqa: E402
from .upstream import load  # noqa: E402

modeling_common, configuration_common = load()


class MHCModelTester(DecoderModelTester):
    config_class = MHCConfig
    base_model_class = MHCModel
    causal_lm_class = MHCForCausalLM
    family_options = {"hc_mult": 4}


class MHCOneStreamModelTester(MHCModelTester):
    family_options = {"hc_mult": 1}


class MHCModelTest(CausalLMModelTest, modeling_common.ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    model_tester_class = MHCModelTester
    config_tester_class = configuration_common.ConfigTester
    test_can_init_all_missing_weights_before_2023 = True

    def test_hidden_states_output(self):
        # Replaces the common test, whose [B, T, D] shape check cannot hold by design (as transformers' own tests of
        # its hyper-connection models, DeepSeek-V4, replace it): num_hidden_layers + 1 states, the streams
        # [B, T, n, D] before the last layer's output and the collapsed state [B, T, D] last, with the flag given
        # as an argument and in the config.
        for model_class in self.all_model_classes:
            for where in ("argument", "config"):
                config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
                if where == "config":
                    config.output_hidden_states = True
                else:
                    inputs["output_hidden_states"] = True
                model = model_class(config).eval()
                with torch.no_grad():
                    states = model(**inputs).hidden_states
                self.assertEqual(len(states), config.num_hidden_layers + 1)
                batch_size, length = inputs["input_ids"].shape
                for index, state in enumerate(states):
                    self.assertEqual(state.shape, self.hidden_state_shape(config, index, batch_size, length))

    def hidden_state_shape(self, config, index, batch_size, length):
        # By design the residual is hc_mult streams: the embedding and every layer's output before the last are
        # [B, T, n, D]; the last entry is the collapsed, normed state [B, T, D] (modeling_mhc.py).
        if index < config.num_hidden_layers:
            return (batch_size, length, config.hc_mult, config.hidden_size)
        return (batch_size, length, config.hidden_size)


class MHCOneStreamModelTest(MHCModelTest):
    model_tester_class = MHCOneStreamModelTester


class MHCQwen3ModelTester(Qwen3BackboneTester, MHCModelTester):
    pass


class MHCQwen3ModelTest(MHCModelTest):
    model_tester_class = MHCQwen3ModelTester
