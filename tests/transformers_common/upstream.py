"""transformers' own common model tests, taken from the sdist of the installed transformers at test time.

The sdist (``transformers==<installed version>``) ships ``tests/test_modeling_common.py`` and
``tests/test_configuration_common.py``, but not three modules they import; this module supplies those:

- ``.generation.test_utils.GenerationTesterMixin``: ours, ``generation_mixin.py`` (the mixin is not in the sdist);
- ``.exporters.test_export.ExportTesterMixin``: ours, ``export_mixin.py`` (the base class of ``ModelTesterMixin``);
- ``.utils.test_configuration_utils.config_common_kwargs``: built here from ``PreTrainedConfig``'s own fields.

The suite finds a model's base class, LM head and label layout by class name in transformers' tables of its own
models (``MODEL_MAPPING_NAMES``, ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ...), which a plugin registered with
``AutoModel.register`` is not in. :func:`load` gives the loaded test module (only it: transformers' own tables are
untouched) copies of those tables with every family of ``depthfusion_hf.families.FAMILIES`` added, as a family
inside transformers would be listed.

Where the files come from, in this order:

1. ``$DEPTHFUSION_TRANSFORMERS_SDIST``: a path to ``transformers-<version>.tar.gz``;
2. the cache, ``$DEPTHFUSION_DATA_DIR`` or ``~/.cache/depthfusion_hf`` (the plays corpus's), under
   ``transformers_tests/<version>/``;
3. otherwise ``python -m pip download transformers==<version> --no-deps --no-binary :all:`` into that cache
   (online once; pip checks the archive against the index's hash).

The two files are extracted unchanged into a package ``transformers_tests_<version>`` in the cache (written to a
temporary folder and renamed into place, so that a concurrent or interrupted run never sees half a package) and
imported from there. ``parameterized`` (transformers' own test dependency) is used when installed, otherwise its
wheel is fetched into the same cache and imported from the wheel. Nothing of transformers is kept in this
repository. When a file cannot be had, :func:`load` raises :class:`UpstreamTestsUnavailable` with pip's error:
the tests fail (they do not skip).
"""

import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers
from transformers import PreTrainedConfig

from depthfusion_hf.data.plays import cache_dir

UPSTREAM_FILES = ("test_modeling_common.py", "test_configuration_common.py")
PARAMETERIZED = "parameterized==0.9.0"
# Fields of PreTrainedConfig that config_common_kwargs leaves out: set by transformers itself, not by a user.
_BOOKKEEPING_FIELDS = ("is_encoder_decoder", "_name_or_path", "transformers_version")


class UpstreamTestsUnavailable(RuntimeError):
    """transformers' common test files (or their test dependency) could not be found or downloaded."""


def _pip(args: list[str], what: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UpstreamTestsUnavailable(
            f"could not download {what} with `{' '.join(command)}` (exit {proc.returncode}):\n{proc.stderr[-2000:]}\n"
            "transformers' common tests need it; download it by hand"
            + (" and set DEPTHFUSION_TRANSFORMERS_SDIST to its path" if "sdist" in what else "")
        )


def _download_once(target: Path, pip_args: list[str], what: str) -> Path:
    """``target`` (a file pip downloads), downloaded into a temporary folder beside it and moved into place."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        _pip([*pip_args, "-d", tmp], what)
        found = Path(tmp) / target.name
        if not found.exists():
            raise UpstreamTestsUnavailable(f"pip downloaded {what} but not {target.name} (got {os.listdir(tmp)})")
        os.replace(found, target)
    return target


def sdist_path(version: str = transformers.__version__) -> Path:
    """The ``transformers-<version>.tar.gz`` sdist: ``$DEPTHFUSION_TRANSFORMERS_SDIST``, else cached or downloaded."""
    override = os.environ.get("DEPTHFUSION_TRANSFORMERS_SDIST")
    if override:
        if not Path(override).is_file():
            raise UpstreamTestsUnavailable(f"DEPTHFUSION_TRANSFORMERS_SDIST={override} is not a file")
        return Path(override)
    target = cache_dir() / "transformers_tests" / version / f"transformers-{version}.tar.gz"
    return _download_once(target, ["download", "--no-deps", "--no-binary", ":all:", f"transformers=={version}"],
                          f"the transformers {version} sdist")


def package_name(version: str = transformers.__version__) -> str:
    """The import name of the extracted test package, e.g. ``transformers_tests_5_24_0``."""
    return "transformers_tests_" + re.sub(r"\W", "_", version)


def extract_tests(sdist: Path, version: str = transformers.__version__) -> Path:
    """The folder holding the package :func:`package_name` with the sdist's two common test files (unchanged) and an
    empty ``__init__.py``; extracted once per version."""
    root = cache_dir() / "transformers_tests" / version
    package = root / package_name(version)
    if all((package / name).is_file() for name in UPSTREAM_FILES):
        return root
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as archive:
        members = {Path(member.name).name: member for member in archive.getmembers()
                   if re.fullmatch(r"[^/]+/tests/[^/]+\.py", member.name) and member.isfile()}
        missing = [name for name in UPSTREAM_FILES if name not in members]
        if missing:
            raise UpstreamTestsUnavailable(f"{sdist} has no tests/{missing[0]}: not a transformers sdist with tests")
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".extract-"))
        try:
            for name in UPSTREAM_FILES:
                (tmp / name).write_bytes(archive.extractfile(members[name]).read())
            (tmp / "__init__.py").write_text("")
            try:
                os.replace(tmp, package)
            except OSError:  # another run put it in place first (a non-empty folder cannot be replaced)
                if not all((package / name).is_file() for name in UPSTREAM_FILES):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def ensure_parameterized() -> None:
    """Make ``parameterized`` importable: the installed one, else its wheel from the cache (fetched once)."""
    try:
        import parameterized  # noqa: F401
        return
    except ImportError:
        pass
    name, version = PARAMETERIZED.split("==")
    wheel = cache_dir() / "transformers_tests" / f"{name}-{version}-py2.py3-none-any.whl"
    _download_once(wheel, ["download", "--no-deps", "--only-binary", ":all:", PARAMETERIZED],
                   f"{PARAMETERIZED} (a test dependency of transformers' common tests)")
    sys.path.insert(0, str(wheel))  # a pure-Python wheel is a zip archive Python imports from
    importlib.invalidate_caches()
    import parameterized  # noqa: F401,F811


def config_common_kwargs() -> dict:
    """Every user-settable field of ``PreTrainedConfig``, each with a value other than its default (what transformers'
    ``tests/utils/test_configuration_utils.config_common_kwargs`` holds; ``check_config_arguments_init`` builds a
    config from it and checks each field was set).

    Raises:
        UpstreamTestsUnavailable: ``PreTrainedConfig`` has a field this table has no value for (a newer transformers).
    """
    values = {
        "return_dict": False,
        "output_hidden_states": True,
        "output_attentions": True,
        "dtype": "float16",
        "chunk_size_feed_forward": 5,
        "architectures": ["BertModel"],
        "id2label": {0: "label"},
        "label2id": {"label": "0"},
        "problem_type": "regression",
    }
    defaults = PreTrainedConfig()
    fields = [name.removeprefix("_") for name in vars(defaults)
              if name not in _BOOKKEEPING_FIELDS and not name.endswith(("_internal", "_post_init_done"))]
    missing = [name for name in fields if name not in values]
    if missing:
        raise UpstreamTestsUnavailable(f"config_common_kwargs has no value for PreTrainedConfig's fields {missing} "
                                       f"(transformers {transformers.__version__}): add one to {__file__}")
    unchanged = [name for name, value in values.items() if getattr(defaults, name) == value]
    if unchanged:
        raise UpstreamTestsUnavailable(f"config_common_kwargs sets {unchanged} to their defaults: pick other values")
    return values


def _add_our_families(modeling_common: types.ModuleType) -> None:
    """Rebind the test module's model-name tables to copies listing our families (see the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from depthfusion_hf.families import FAMILIES

    tables = {AutoModelForCausalLM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
              AutoModelForTokenClassification: "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"}
    extra = {"MODEL_MAPPING_NAMES": {}, **{table: {} for table in tables.values()}}
    for model_type, family in FAMILIES.items():
        if family.base_model_class is not None:
            extra["MODEL_MAPPING_NAMES"][model_type] = family.base_model_class.__name__
        extra[tables[family.task_auto_class]][model_type] = family.task_model_class.__name__
    for table, entries in extra.items():
        setattr(modeling_common, table, {**getattr(modeling_common, table), **entries})


def _install_module(name: str, **attributes) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    module.__path__ = []  # a package, so that its submodules import
    sys.modules[name] = module


def load() -> tuple[types.ModuleType, types.ModuleType]:
    """``(test_modeling_common, test_configuration_common)`` of the installed transformers, imported once.

    Raises:
        UpstreamTestsUnavailable: the sdist or ``parameterized`` could not be found or downloaded (pip's error shown).
    """
    package = package_name()
    if f"{package}.test_modeling_common" not in sys.modules:
        ensure_parameterized()
        root = str(extract_tests(sdist_path()))
        if root not in sys.path:
            sys.path.insert(0, root)
        from .export_mixin import ExportTesterMixin
        from .generation_mixin import GenerationTesterMixin

        importlib.import_module(package)
        _install_module(f"{package}.generation")
        _install_module(f"{package}.generation.test_utils", GenerationTesterMixin=GenerationTesterMixin)
        _install_module(f"{package}.exporters")
        _install_module(f"{package}.exporters.test_export", ExportTesterMixin=ExportTesterMixin)
        _install_module(f"{package}.utils")
        _install_module(f"{package}.utils.test_configuration_utils", config_common_kwargs=config_common_kwargs())
        _add_our_families(importlib.import_module(f"{package}.test_modeling_common"))
    return (importlib.import_module(f"{package}.test_modeling_common"),
            importlib.import_module(f"{package}.test_configuration_common"))
