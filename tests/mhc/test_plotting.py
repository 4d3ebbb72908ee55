"""The mHC analysis figure: written from a model's hyper-connection weights; wrong shapes are rejected."""

import pytest
import torch

from depthfusion_hf.models.modeling_mhc import MHCForCausalLM
from depthfusion_hf.plotting_mhc import check_mhc_weights, plot_mhc_analysis, plot_mhc_weights

from .helpers import randomise_mhc, tiny_config


@pytest.mark.parametrize("layers", [3, 13])  # one row of comb panels; two rows (more than 12 layers)
def test_analysis_figure_is_written(tmp_path, layers):
    model = randomise_mhc(MHCForCausalLM(tiny_config(num_hidden_layers=layers))).eval()
    path = plot_mhc_analysis(model, tmp_path / "run", torch.randint(3, 97, (1, 12)), "mhc n4, 0 steps")
    assert path == tmp_path / "run" / "mhc_weights.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_weights_of_other_shapes_are_rejected(tmp_path):
    weights = {"pre": torch.rand(3, 2, 4), "post": torch.rand(3, 2, 4), "comb": torch.rand(3, 2, 4, 4),
               "head": torch.rand(4)}
    assert check_mhc_weights(weights) == (3, 4)
    with pytest.raises(ValueError, match=r"weights\['comb'\] must have shape \(3, 2, 4, 4\)"):
        plot_mhc_weights(weights | {"comb": torch.rand(3, 2, 4)}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="missing \\['head'\\]"):
        plot_mhc_weights({k: v for k, v in weights.items() if k != "head"}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
