"""The export tests ``ModelTesterMixin`` inherits (transformers' ``tests/exporters/test_export.py``, which the sdist
does not ship), for the Dynamo backend: every model class exports with transformers' own ``DynamoExporter``
(``torch.export`` underneath), with static and with dynamic shapes, and the exported program computes what the eager
model computes. The ONNX, OpenVINO and ExecuTorch backends of upstream's mixin need packages this project does not
install, and are left out."""

import copy

import torch
from parameterized import parameterized
from transformers.exporters.exporter_dynamo import DynamoConfig, DynamoExporter

RTOL = ATOL = 1e-5


def _output_tensors(outputs) -> dict:
    """The outputs an exported program must reproduce: logits and last hidden state, where the model has them."""
    return {name: outputs[name] for name in ("logits", "last_hidden_state") if outputs.get(name) is not None}


class ExportTesterMixin:
    """Expects ``all_model_classes``, ``model_tester`` and ``test_torch_exportable`` (``ModelTesterMixin``'s)."""

    @parameterized.expand([("static", False), ("dynamic", True)])
    def test_torch_export(self, _, dynamic):
        if not self.test_torch_exportable:
            self.skipTest(reason="Model architecture is not Dynamo exportable/traceable")
        for model_class in self.all_model_classes:
            with self.subTest(model_class.__name__):
                config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
                model = model_class(copy.deepcopy(config)).eval()
                inputs = {name: value for name, value in inputs.items() if value is not None}
                with torch.no_grad():
                    expected = _output_tensors(model(**inputs))
                exported = DynamoExporter().export(model, dict(inputs), config=DynamoConfig(dynamic=dynamic))
                with torch.no_grad():
                    actual = _output_tensors(exported(**inputs))
                self.assertEqual(set(actual), set(expected))
                for name in expected:
                    torch.testing.assert_close(actual[name], expected[name], rtol=RTOL, atol=ATOL)
