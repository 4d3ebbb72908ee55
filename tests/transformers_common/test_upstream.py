"""The harness that brings transformers' common tests in: what it extracts, what it adds, and that a missing sdist
is an error (the suite fails) rather than a skip."""

import tarfile

import pytest
import transformers
from transformers import PreTrainedConfig

from . import upstream


def test_the_extracted_files_are_the_sdists_own():
    sdist = upstream.sdist_path()
    package = upstream.extract_tests(sdist) / upstream.package_name()
    with tarfile.open(sdist, "r:gz") as archive:
        for name in upstream.UPSTREAM_FILES:
            member = archive.getmember(f"transformers-{transformers.__version__}/tests/{name}")
            assert (package / name).read_bytes() == archive.extractfile(member).read()


def test_config_common_kwargs_sets_every_common_field_away_from_its_default():
    values = upstream.config_common_kwargs()
    config = PreTrainedConfig(**values)
    defaults = PreTrainedConfig()
    for name, value in values.items():
        if name == "dtype":
            assert str(config.dtype) == "torch.float16"
        else:
            assert getattr(config, name) == value != getattr(defaults, name)


def test_the_test_module_lists_our_families_and_transformers_tables_are_untouched():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    from depthfusion_hf.families import FAMILIES

    modeling_common, _ = upstream.load()
    for model_type, family in FAMILIES.items():
        assert model_type not in MODEL_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if family.is_causal_lm:
            assert modeling_common.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == family.task_model_class.__name__
            assert modeling_common.MODEL_MAPPING_NAMES[model_type] == family.base_model_class.__name__
        else:
            assert modeling_common.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES[model_type] == \
                family.task_model_class.__name__


def test_an_sdist_pip_cannot_download_is_an_error_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHFUSION_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing: what an unreachable index gives
    monkeypatch.delenv("DEPTHFUSION_TRANSFORMERS_SDIST", raising=False)
    with pytest.raises(upstream.UpstreamTestsUnavailable, match=r"pip download --no-deps --no-binary :all: "
                       r"transformers==0\.0\.1(.|\n)*DEPTHFUSION_TRANSFORMERS_SDIST"):
        upstream.sdist_path("0.0.1")
    assert not list((tmp_path / "transformers_tests" / "0.0.1").iterdir())  # no half-downloaded file left


def test_a_missing_override_path_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHFUSION_TRANSFORMERS_SDIST", str(tmp_path / "absent.tar.gz"))
    with pytest.raises(upstream.UpstreamTestsUnavailable, match="DEPTHFUSION_TRANSFORMERS_SDIST=.*is not a file"):
        upstream.sdist_path()
