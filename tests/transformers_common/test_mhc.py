"""mHC (n = 4 and n = 1 streams) through transformers' common suite and our generation tests, once the family is in
the registry (``depthfusion_hf.families.FAMILIES``)."""

import unittest

import pytest

from depthfusion_hf.families import FAMILIES

if "mhc" not in FAMILIES:
    pytest.skip("the mHC family is not registered in depthfusion_hf.families yet (issue 22)", allow_module_level=True)

from depthfusion_hf.models.mhc import MHCConfig, MHCForCausalLM, MHCModel  # noqa: E402

from .generation_mixin import GenerationTesterMixin  # noqa: E402
from .testers import CausalLMModelTest, DecoderModelTester  # noqa: E402
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


class MHCOneStreamModelTest(MHCModelTest):
    model_tester_class = MHCOneStreamModelTester
