"""The two grids: every family against the same-seed Llama trained from scratch (``scripts/compare_families.py``),
and a pre-trained Llama continued as itself and upcycled into each family (``scripts/upcycle.py``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

from transformers import PreTrainedModel, set_seed

from ...convert import load_llama_start, load_source
from ...families import FAMILIES
from ..clm import BASELINE, TrainSettings, build_config, build_model, new_parameter_names, run_name
from .data import StudyData
from .specs import ModelSpec, spec_field_names
from .store import RunStore
from .training import train_recorded


def build_seeded_pair(spec: ModelSpec, arch: dict, layers: int, seed: int, tokenizer) -> tuple[PreTrainedModel, str]:
    """The model of ``spec`` at ``layers`` blocks whose Llama weights equal the same-seed Llama's.

    The Llama is built first from ``seed``; the family model is then built from ``seed`` too (its own
    initialisation for its new weights: DWA identity, zero pseudo-queries, MoDA's FFN-side K/V projections) and
    the Llama's state dict is loaded into it. Returns the model and ``"shared"``; a family whose parameter names
    or shapes do not fit the Llama's keeps its own seeded initialisation (``"own"``).
    """
    fields = dict(arch, num_hidden_layers=layers)
    set_seed(seed)
    llama = build_model(BASELINE, fields, tokenizer)
    if spec.is_baseline:
        return llama, "shared"
    set_seed(seed)
    spec_fields = spec.fields_at(layers)
    config_fields, _ = spec_field_names(spec.kind)
    upcycling_only = sorted(set(spec_fields) - config_fields)
    if upcycling_only:
        raise ValueError(f"model spec {spec.text!r}: {upcycling_only} apply to upcycling only (scripts/upcycle.py); "
                         "a model trained from scratch has no Llama to convert")
    config = build_config(spec.kind, fields, **spec_fields)
    model = build_model(spec.kind, tokenizer=tokenizer, config=config)
    return model, "shared" if load_llama_start(model, llama.state_dict()) else "own"


def run_compare_grid(
    specs: Sequence[ModelSpec],
    seeds: Sequence[int],
    layers: Sequence[int],
    arch: dict,
    data: StudyData,
    settings: TrainSettings,
    store: RunStore,
    dataset_label: str,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train every (depth, seed, model) not yet in ``store``; returns every stored record of the grid.

    Runs go depth by depth, seed by seed, the Llama first, so that an interrupted study has complete pairs.
    """
    ordered = sorted(specs, key=lambda s: not s.is_baseline)
    grid = [(depth, seed, spec) for depth in layers for seed in seeds for spec in ordered]
    records = []
    for done, (depth, seed, spec) in enumerate(grid, start=1):
        key, record = store.find(spec.text, layers=depth, seed=seed)
        if record is None:
            model, init = build_seeded_pair(spec, arch, depth, seed, data.tokenizer)
            log(f"[{done}/{len(grid)}] {key}: training ({init} init)")
            outcome = train_recorded(model, data, dataclasses.replace(settings, seed=seed), name=spec.text)
            record = _store(store, key, spec, model, outcome, fields=spec.fields_at(depth), seed=seed, layers=depth,
                            dataset=dataset_label, init=init)
            log(f"    val loss {outcome.eval_loss:.4f}, {outcome.train_seconds:.0f} s")
        else:
            log(f"[{done}/{len(grid)}] {key}: stored, skipped")
        records.append(record)
    return records


def run_continuations(
    specs: Sequence[ModelSpec],
    seeds: Sequence[int],
    lr_scales: Sequence[float],
    llama_path: str | os.PathLike,
    data: StudyData,
    settings: TrainSettings,
    store: RunStore,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Continue the Llama at ``llama_path`` as itself and upcycled to each spec, per seed and new-parameter lr scale.

    The Llama continues at scale 1 only (it has no new parameters); every family is upcycled with its registry
    ``from_llama`` and trained with its new parameters at each scale of ``lr_scales``. Every run evaluates at
    step 0 (the upcycled model before any update) and on the test split at the end.
    """
    records = []
    for seed in seeds:
        for spec in sorted(specs, key=lambda s: not s.is_baseline):
            for scale in ([1.0] if spec.is_baseline else lr_scales):
                key, record = store.find(spec.text, seed=seed, lr_scale=scale)
                if record is not None:
                    log(f"{key}: stored, skipped")
                    records.append(record)
                    continue
                llama = load_source(llama_path)
                fields = spec.fields_at(llama.config.num_hidden_layers)
                if spec.is_baseline:
                    model, new = llama, []
                else:
                    family = FAMILIES[spec.kind]
                    if family.from_llama is None:
                        raise ValueError(f"{spec.kind} has no Llama upcycling (its registry entry has no from_llama)")
                    model = family.from_llama(llama, **fields)
                    new = new_parameter_names(model, llama.state_dict())
                log(f"{key}: training ({len(new)} new parameter tensors at {scale:g}x lr)")
                outcome = train_recorded(model, data, dataclasses.replace(settings, seed=seed), name=spec.text,
                                         new_names=new, new_param_lr_scale=scale, test=data.test is not None)
                records.append(_store(store, key, spec, model, outcome, fields=fields, seed=seed, lr_scale=scale,
                                      new_parameters=new))
                log(f"    val loss {outcome.eval_loss:.4f}")
    return records


def _store(store: RunStore, key: str, spec: ModelSpec, model: PreTrainedModel, outcome, **parts) -> dict:
    """The record of a finished run (its spec, model names, ``parts`` and the outcome), stored under ``key``."""
    record = dict(spec=spec.text, name=run_name(model.config), model_type=model.config.model_type, **parts,
                  **dataclasses.asdict(outcome))
    store.put(key, record)
    return record


__all__ = ["build_seeded_pair", "run_compare_grid", "run_continuations"]
