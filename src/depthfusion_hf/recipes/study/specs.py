"""Model specs: the short names of the models a study (and ``benchmarks/bench_models.py``) compares.

A spec is ``kind[:variant]``: ``llama`` (the baseline), or a causal-LM family of the registry
(:data:`depthfusion_hf.families.FAMILIES`) with a short variant or, for any family (one added later too),
``family:field=value+field=value`` in its config's field names:

========================  ===========================================================================
``llama``                 transformers' Llama, the paired baseline
``denseformer:KxP``       DenseFormer with dilation K and period P (``denseformer`` alone: 1x1)
``moda[:no-ffn-kv][+post-norm]``  MoDA (default: FFN-side depth K/V, pre-norm)
``attnres:full``          full AttnRes (``attnres`` alone too)
``attnres:blockN``        block AttnRes with **N blocks** (the paper's meaning): ``2L / N`` sub-layers per
                          block at L layers, so N must divide the ``2L`` sub-layers
``attnres:attnres_block_size=S``  block AttnRes with S sub-layers per block at every depth
========================  ===========================================================================
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...families import FAMILIES, causal_lm_families
from ..clm import BASELINE

# The models both studies compare by default: the Llama and one variant of every family, as in the recorded studies
# (docs/studies/: AttnRes with blocks of 8 sub-layers).
DEFAULT_MODELS = "llama,denseformer:1x1,denseformer:4x5,moda,attnres:attnres_block_size=8"

# A variant parser: the variant text -> (fixed config fields, fields that depend on the depth L or None).
DepthFields = Callable[[int], dict[str, Any]]
VariantParser = Callable[[str], tuple[dict[str, Any], DepthFields | None]]


def _denseformer_variant(variant: str) -> tuple[dict[str, Any], None]:
    match = re.fullmatch(r"(\d+)x(\d+)", variant)
    if match is None:
        raise ValueError(f"denseformer variant must be KxP (dilation x period, e.g. 4x5); got {variant!r}")
    return {"dwa_dilation": int(match[1]), "dwa_period": int(match[2])}, None


def _moda_variant(variant: str) -> tuple[dict[str, Any], None]:
    fields: dict[str, Any] = {}
    for part in variant.split("+"):
        if part == "no-ffn-kv":
            fields["moda_ffn_kv"] = False
        elif part in ("pre-norm", "post-norm"):
            fields["norm_position"] = part.split("-")[0]
        else:
            raise ValueError(f"moda variant parts must be 'no-ffn-kv', 'pre-norm' or 'post-norm' joined by '+'; "
                             f"got {part!r}")
    return fields, None


def attnres_block_size(blocks: int, layers: int) -> int:
    """Sub-layers per block of block AttnRes with ``blocks`` blocks at ``layers`` layers (``2 * layers`` sub-layers).

    Raises:
        ValueError: ``blocks`` does not divide the sub-layers (naming the block counts that do).
    """
    sublayers = 2 * layers
    if blocks < 1 or sublayers % blocks:
        counts = [n for n in range(1, sublayers + 1) if sublayers % n == 0]
        raise ValueError(f"attnres:block{blocks} at {layers} layers: {sublayers} sub-layers do not form {blocks} "
                         f"equal blocks; block counts that do: {counts} (or give the block size: "
                         "attnres:attnres_block_size=S)")
    return sublayers // blocks


def _attnres_variant(variant: str) -> tuple[dict[str, Any], DepthFields | None]:
    if variant == "full":
        return {"attnres_block_size": None}, None
    match = re.fullmatch(r"block(\d+)", variant)
    if match is None:
        raise ValueError(f"attnres variant must be 'full' or 'blockN' (N blocks, e.g. block8), or give the block "
                         f"size as attnres:attnres_block_size=S; got {variant!r}")
    blocks = int(match[1])
    return {}, lambda layers: {"attnres_block_size": attnres_block_size(blocks, layers)}


# Short variant syntaxes of the registry's families (model_type -> (syntax help, parser)). A family without an
# entry here still takes the generic ``family:field=value+field=value`` form.
SPEC_SHORTHANDS: dict[str, tuple[str, VariantParser]] = {
    "denseformer": ("denseformer:KxP (dilation x period; default 1x1)", _denseformer_variant),
    "moda": ("moda[:no-ffn-kv][+post-norm] (default: FFN-side depth K/V, pre-norm)", _moda_variant),
    "attnres": ("attnres:full | attnres:blockN (N blocks: 2L/N sub-layers each; default full)", _attnres_variant),
}


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass(frozen=True)
class ModelSpec:
    """One model of a study.

    Attributes:
        text: the spec as written (``"denseformer:4x5"``); the run store's key and the tables' label.
        kind: ``"llama"`` or a causal-LM ``model_type`` of the family registry.
        fields: the config fields the spec fixes (``{"dwa_dilation": 4, "dwa_period": 5}``).
        depth_fields: the fields that depend on the depth (``attnres:blockN``), or ``None``.
    """

    text: str
    kind: str
    fields: dict = field(default_factory=dict, hash=False, compare=False)
    depth_fields: DepthFields | None = field(default=None, hash=False, compare=False)

    @property
    def is_baseline(self) -> bool:
        """True for the plain Llama."""
        return self.kind == BASELINE

    def fields_at(self, layers: int) -> dict[str, Any]:
        """The config fields of this model at ``layers`` layers.

        Raises:
            ValueError: the spec has no model at that depth (e.g. ``attnres:block8`` at 6 layers).
        """
        return dict(self.fields, **(self.depth_fields(layers) if self.depth_fields else {}))


def spec_syntax() -> str:
    """One line per model kind: how to write its spec (for ``--help``)."""
    lines = [f"{BASELINE}"]
    for kind in causal_lm_families():
        short = SPEC_SHORTHANDS.get(kind)
        options = sorted(spec_field_names(kind)[1])
        extra = f"; upcycling only: {', '.join(options)}" if options else ""
        generic = f"{kind}:field=value+field=value (any {FAMILIES[kind].config_class.__name__} field{extra})"
        lines.append(f"{short[0]}; or {generic}" if short else generic)
    return "\n".join(lines)


def spec_field_names(kind: str) -> tuple[set[str], set[str]]:
    """The names a spec of ``kind`` may set: its config's fields, and the options only its registry ``from_llama``
    takes (e.g. MoDA's ``ffn_kv_init``; valid for upcycling only)."""
    family = FAMILIES[kind]
    config_fields = set(getattr(family.config_class, "__dataclass_fields__", {}))
    options = set()
    if family.from_llama is not None:
        parameters = list(inspect.signature(family.from_llama).parameters.values())[1:]  # after the model
        options = {q.name for q in parameters if q.kind is q.POSITIONAL_OR_KEYWORD or q.kind is q.KEYWORD_ONLY}
    return config_fields, options - config_fields


def parse_model_spec(text: str) -> ModelSpec:
    """Parse ``kind[:variant]`` (see the module docstring); the kind is read from the family registry.

    Raises:
        ValueError: an unknown kind (naming the known ones), a bad variant, or a field the family's config lacks.
    """
    text = text.strip()
    kind, _, variant = text.partition(":")
    kinds = causal_lm_families() + (BASELINE,)
    if kind not in kinds:
        raise ValueError(f"model spec {text!r}: kind must be one of {kinds}; got {kind!r}")
    if kind == BASELINE:
        if variant:
            raise ValueError(f"model spec {text!r}: the {BASELINE} baseline takes no variant")
        return ModelSpec(text, kind, {})
    if not variant:
        return ModelSpec(text, kind, {})
    if "=" in variant:
        fields = {}
        for part in variant.split("+"):
            name, sep, value = part.partition("=")
            if not sep or not name:
                raise ValueError(f"model spec {text!r}: expected field=value parts joined by '+'; got {part!r}")
            fields[name] = _json_value(value)
        config_fields, upcycling_options = spec_field_names(kind)
        unknown = sorted(set(fields) - config_fields - upcycling_options)
        if unknown:
            raise ValueError(f"model spec {text!r}: {FAMILIES[kind].config_class.__name__} has no field(s) {unknown} "
                             f"(upcycling options: {sorted(upcycling_options)})")
        return ModelSpec(text, kind, fields)
    if kind not in SPEC_SHORTHANDS:
        raise ValueError(f"model spec {text!r}: {kind} has no short variant syntax; write {kind}:field=value")
    fields, depth_fields = SPEC_SHORTHANDS[kind][1](variant)
    return ModelSpec(text, kind, fields, depth_fields)


def parse_model_list(text: str, layers: Sequence[int] = ()) -> list[ModelSpec]:
    """Parse a comma-separated list of specs; the Llama baseline must be in it (every comparison is paired with it).
    Every spec must have a model at each depth of ``layers``.

    Raises:
        ValueError: a bad spec, a repeated spec, no ``llama``, or a spec without a model at one of ``layers``.
    """
    specs = [parse_model_spec(part) for part in text.split(",") if part.strip()]
    texts = [s.text for s in specs]
    repeated = sorted({t for t in texts if texts.count(t) > 1})
    if repeated:
        raise ValueError(f"--models lists {repeated} more than once")
    if BASELINE not in texts:
        raise ValueError(f"--models must include {BASELINE!r} (the paired baseline); got {texts}")
    for spec in specs:
        for depth in layers:
            spec.fields_at(depth)
    return specs


__all__ = ["DEFAULT_MODELS", "SPEC_SHORTHANDS", "ModelSpec", "attnres_block_size", "parse_model_list",
           "parse_model_spec", "spec_field_names", "spec_syntax"]
