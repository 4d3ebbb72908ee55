"""Causal-LM training recipe: build a depth-fusion model or its Llama baseline, train it with the Trainer.

The command-line front end is ``scripts/train_clm.py``; this module holds the pieces it (and the
tests) call: the model factory, the training arguments, one training run, and the results table.
"""

from __future__ import annotations

import difflib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
    set_seed,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..convert import load_llama_start, load_source, source_config_fields
from ..data.textfile import DataFormatError, read_json_file
from ..families import FAMILIES, Family, causal_lm_families
from ..models.backbones import as_backbone_config
from ..models.transformers_compat import CHECKPOINTING_TRAINING_ARG
from ..remote_code import save_remote_code_folder
from .checkpoints import CheckpointExtras, full_disk_error, get_last_checkpoint
from .records import table_lines

# The plain baseline every causal-LM family is compared with (not a registry family: transformers' own).
BASELINE = "llama"


def _config_fields(kind: str | None) -> set[str]:
    """The field names of ``kind``'s config class (``None``: of every causal-LM family and Llama)."""
    kinds = [kind] if kind is not None else [*causal_lm_families(), BASELINE]
    classes = [LlamaConfig if k == BASELINE else FAMILIES[k].config_class for k in kinds]
    return {name for cls in classes for name in cls.__dataclass_fields__}


def load_arch(path: str | Path, kind: str | None = None) -> dict:
    """Read a model-config JSON (``configs/*.json``, or a saved ``config.json``): its fields, without comments (keys
    starting with ``_``) and ``model_type``.

    Args:
        kind: the model the fields are for (``--model``); ``None``: any causal-LM family.
    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not UTF-8 JSON holding an object (names the file and line); it names a
            ``model_type`` other than ``kind`` (or ``llama``: plain Llama fields suit every family); a key is a near
            miss of a config field (``num_hiden_layers``; names the nearest field). A family's own config class then
            refuses misspelt family options (e.g. ``dwa_dilaton``).
    """
    arch = read_json_file(path)
    if not isinstance(arch, dict):
        raise DataFormatError(path, None, f"a model config must be a JSON object; got {type(arch).__name__}")
    model_type = arch.get("model_type")
    if kind is not None and model_type is not None and model_type not in (kind, BASELINE):
        raise ValueError(f"{path} is a config of model_type {model_type!r}, not {kind!r}: pass --model {model_type}, "
                         f"or a config of {kind!r} or of Llama fields only")
    fields = {k: v for k, v in arch.items() if not k.startswith("_") and k != "model_type"}
    valid = _config_fields(kind)
    for key in fields.keys() - valid:
        near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.85)
        if near:
            raise ValueError(f"{path}: `{key}` is not a config field; the nearest valid name is `{near[0]}`")
    return fields


def _family(kind: str) -> Family | None:
    """The registry entry of a causal-LM ``kind``; ``None`` for the Llama baseline."""
    kinds = causal_lm_families() + (BASELINE,)  # read now: the registry is the one list
    if kind not in kinds:
        raise ValueError(f"model kind must be one of {kinds}; got {kind!r}")
    return None if kind == BASELINE else FAMILIES[kind]


def add_family_options(parser) -> None:
    """Add every causal-LM family's command-line options (from the registry) to ``parser``."""
    for kind in causal_lm_families():
        if FAMILIES[kind].add_cli_options is not None:
            FAMILIES[kind].add_cli_options(parser)


def family_kwargs(kind: str, args) -> dict:
    """The family-specific config fields for ``kind`` taken from parsed CLI arguments (none for the baseline)."""
    family = _family(kind)
    if family is None or family.config_kwargs is None:
        return {}
    return family.config_kwargs(args)


def tokenizer_fields(tokenizer) -> dict:
    """The config fields a tokenizer fixes: vocabulary size and the bos/eos/pad token ids."""
    return dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def build_model(
    kind: str,
    arch: dict | None = None,
    tokenizer=None,
    init_from: str | None = None,
    config: PretrainedConfig | None = None,
    **kwargs,
) -> PreTrainedModel:
    """Build a fresh model of ``kind`` (a causal-LM family of the registry, or ``llama``).

    Args:
        kind: the model family.
        arch: Llama-style config fields (hidden_size, num_hidden_layers, ...); ignored when ``config`` is given.
        tokenizer: when given, sets vocab size and the bos/eos/pad token ids.
        init_from: a Llama checkpoint (folder or Hub id) to upcycle instead of a random init;
            ``arch`` and ``config`` are then ignored.
        config: an already built (and validated) config of ``kind``, e.g. from :func:`build_config`, so that
            a run builds its config once.
        kwargs: family fields (``dwa_dilation``, ``moda_ffn_kv``, ...).
    """
    family = _family(kind)
    if init_from is not None:
        llama = load_source(init_from)
        if family is None:
            return llama
        if family.from_llama is None:
            raise ValueError(f"{kind} has no Llama upcycling; build it without init_from")
        return family.from_llama(llama, **kwargs)
    extra = tokenizer_fields(tokenizer) if tokenizer is not None else {}
    if config is None:
        config = build_config(kind, dict(arch or {}) | extra, **kwargs)
    for key, value in extra.items():  # a config built before the tokenizer existed
        setattr(config, key, value)
    if family is None:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)  # LlamaForCausalLM, or the backbone's own causal LM
    return family.task_model_class(config)


def build_config(kind: str, fields: dict, **kwargs) -> PretrainedConfig:
    """The config of ``kind`` from Llama-style ``fields`` plus family fields; validates them (ValueError). The
    baseline of fields with a ``backbone_config`` is that backbone's own config (the other fields set in it)."""
    family = _family(kind)
    if family is None:
        others = {key: value for key, value in fields.items() if key != "backbone_config"}
        backbone = fields.get("backbone_config")
        return LlamaConfig(**others) if backbone is None else as_backbone_config(dict(backbone) | others)
    # Family fields given on the command line override the same fields of a family config file.
    return family.config_class(**(fields | kwargs))


def run_name(config: PretrainedConfig) -> str:
    """The display name of a run's model in results tables: the family's variant name, or ``"llama"``."""
    family = FAMILIES.get(config.model_type)
    return family.variant_name(config) if family is not None else config.model_type


def baseline_arch(model: PreTrainedModel) -> dict:
    """The fields of the same-depth plain baseline of a model: its Llama fields, or ``{"backbone_config": ...}`` of its
    backbone (the baseline is then that backbone's own causal LM)."""
    fields = source_config_fields(model.config)
    return {k: v for k, v in fields.items() if k in LlamaConfig.__dataclass_fields__ or k == "backbone_config"}


def start_from_seeded_llama(model: PreTrainedModel, tokenizer, seed: int) -> bool:
    """Load into ``model`` the weights of the Llama that ``seed`` builds at its shape (the same-seed baseline's start;
    the family's own new parameters keep their seeded init). Returns False, changing nothing, when they do not fit."""
    set_seed(seed)
    return load_llama_start(model, build_model(BASELINE, baseline_arch(model), tokenizer).state_dict())


# The learning-rate multiple of the parameters a Llama lacks when a family is upcycled, chosen on validation by the
# upcycling study (docs/RESULTS.md, "Upcycling"; 3 seeds, 12 layers, width 64): 10x for the DWA weights and MoDA's
# FFN-side K/V projections, 1x for AttnRes's pseudo-queries (10x was worse on 2 of 3 seeds) and mHC's connections
# (10x behind on 3 of 3). A family without an entry starts at 1x. MoDA's 10x is for its ungated conversion
# (depth_gate=False); converted with closed depth gates (llama_to_moda's default) its new parameters train at 1x:
# on SmolLM2-135M, 10x ended above 1x in held-out perplexity on 3 of 3 seeds (docs/RESULTS.md, "real pretrained").
RECOMMENDED_NEW_PARAM_LR_SCALE = {"denseformer": 10.0, "moda": 10.0, "attnres": 1.0, "mhc": 1.0}
GATED_MODA_NEW_PARAM_LR_SCALE = 1.0


def recommended_new_param_lr_scale(kind: str, config: PretrainedConfig | None = None) -> float:
    """The new parameters' learning-rate multiple for an upcycled ``kind`` (1 for the Llama and unlisted families);
    pass the upcycled model's ``config`` so that a MoDA with depth gates (``moda_depth_gate``) gets its own."""
    if kind == "moda" and getattr(config, "moda_depth_gate", False):
        return GATED_MODA_NEW_PARAM_LR_SCALE
    return RECOMMENDED_NEW_PARAM_LR_SCALE.get(kind, 1.0)


def new_parameter_names(model: PreTrainedModel, llama_names: Iterable[str] | None = None) -> list[str]:
    """Names of ``model``'s parameters that a Llama does not have: what depth fusion added (DWA weights, MoDA's
    FFN-side K/V projections, AttnRes pseudo-queries and key norms).

    Args:
        llama_names: the Llama's parameter names (e.g. its ``state_dict()``); by default those of the same-shape
            ``LlamaForCausalLM`` (built on the meta device, so nothing is allocated).
    """
    if llama_names is None:
        with torch.device("meta"):
            llama_names = LlamaForCausalLM(LlamaConfig(**baseline_arch(model))).state_dict().keys()
    known = set(llama_names)
    return [name for name, _ in model.named_parameters() if name not in known]


# Prefixes wrappers (DDP, FSDP1, activation checkpointing, torch.compile) put before the model's own names.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _unwrapped_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if f"{part}." not in _WRAPPER_PREFIXES)


class DepthFusionTrainer(Trainer):
    """``Trainer`` that applies weight decay to matrices only (nanoGPT's rule, used by the DenseFormer paper), and
    can train the parameters named ``new_names`` at ``new_param_lr_scale`` × the learning rate (upcycling: the
    depth-fusion parameters start from scratch while the Llama's are pretrained).

    The stock decay rule decays every parameter except biases and norms, which would pull the DWA weights
    (identity-initialised, ``alpha[i, i] = 1``) towards 0. Here no 1-D parameter is decayed. The learning-rate
    split happens when the optimiser is created, before the scheduler reads the groups' rates, so the schedule
    (warm-up, cosine) applies to both rates alike.

    Raises:
        ValueError: ``new_param_lr_scale`` is not > 0, or a name of ``new_names`` is not a parameter of the model.
    """

    def __init__(self, *args, new_names: Sequence[str] = (), new_param_lr_scale: float = 1.0, **kwargs):
        if not new_param_lr_scale > 0:
            raise ValueError(f"new_param_lr_scale must be > 0; got {new_param_lr_scale}")
        super().__init__(*args, **kwargs)
        self.new_names = tuple(new_names)
        self.new_param_lr_scale = float(new_param_lr_scale)

    def _issue_warnings_after_load(self, load_result) -> None:
        """The stock warnings after a resume loaded the weights, less the tied weights a checkpoint never holds.

        ``save_pretrained`` drops a tied ``lm_head.weight`` (it is the input embedding), so the stock check warned
        "missing keys: ['lm_head.weight']" on every resume of a tied model: noise that hid the warnings that matter.
        """
        tied = set(getattr(self.model, "all_tied_weights_keys", None) or {})
        missing = [key for key in load_result.missing_keys if key not in tied]
        if len(missing) < len(load_result.missing_keys):
            self.model.tie_weights()
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """Names of the parameters that get weight decay: those of the stock rule with 2 or more dims."""
        names = set(super().get_decay_parameter_names(model))
        return [n for n, p in model.named_parameters() if n in names and p.dim() >= 2]

    def create_optimizer(self, model=None):
        """The stock optimiser; with a scale other than 1, each param group split into old and new parameters."""
        optimizer = super().create_optimizer(model)
        if not self.new_names or self.new_param_lr_scale == 1.0:
            return optimizer
        opt_model = self.model if model is None else model
        params = {_unwrapped_name(n): p for n, p in opt_model.named_parameters()}
        missing = set(self.new_names) - params.keys()
        if missing:  # a silently unscaled parameter would be a wrong experiment
            raise ValueError(f"new_names not among the model's parameters: {sorted(missing)}")
        new_ids = {id(params[name]) for name in self.new_names}
        for group in list(optimizer.param_groups):
            new = [p for p in group["params"] if id(p) in new_ids]
            if new:
                group["params"] = [p for p in group["params"] if id(p) not in new_ids]
                optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                           "params": new, "lr": group["lr"] * self.new_param_lr_scale})
        optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        return optimizer


@dataclass
class TrainSettings:
    """Optimisation settings (defaults follow the DenseFormer paper: AdamW 0.9/0.95, wd 0.1, cosine, 5% warm-up)."""

    max_steps: int = 300
    batch_size: int = 16
    learning_rate: float = 1e-3
    weight_decay: float = 0.1
    warmup_ratio: float = 0.05
    eval_steps: int = 100
    save_steps: int = 0
    logging_steps: int = 10
    seed: int = 0
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    bf16: bool = False
    ddp_backend: str | None = None  # torch.distributed backend under torchrun / accelerate ("gloo" on CPU)
    extra: dict = field(default_factory=dict)


def training_arguments(output_dir: Path, settings: TrainSettings) -> TrainingArguments:
    """``TrainingArguments`` for one run (no external loggers; checkpoints only when ``save_steps > 0``)."""
    save = settings.save_steps > 0
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        learning_rate=settings.learning_rate,
        weight_decay=settings.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        lr_scheduler_type="cosine",
        warmup_steps=math.ceil(settings.warmup_ratio * settings.max_steps),
        max_grad_norm=1.0,
        logging_steps=settings.logging_steps,
        eval_strategy="steps" if settings.eval_steps > 0 else "no",
        eval_steps=settings.eval_steps if settings.eval_steps > 0 else None,
        save_strategy="steps" if save else "no",
        save_steps=settings.save_steps if save else 500,
        seed=settings.seed,
        data_seed=settings.seed,
        report_to="none",
        dataloader_num_workers=0,
        **{CHECKPOINTING_TRAINING_ARG: settings.gradient_checkpointing},
        bf16=settings.bf16,
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=settings.ddp_backend,
        # Every parameter of our models (and the Llama baseline) takes part in each forward pass, so DDP
        # need not search the graph for unused ones.
        ddp_find_unused_parameters=False,
        **settings.extra,
    )


def is_main_process() -> bool:
    """True on the process that writes outputs: rank 0 under torchrun / accelerate launch, or a single process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class RunResult:
    """What one training run measured (``model_type`` names the family, ``"llama"`` for the baseline)."""

    name: str
    model_type: str
    parameters: int
    eval_loss: float
    train_loss: float
    train_seconds: float
    tokens_per_second: float
    log_history: list = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        """``exp(eval_loss)``."""
        return math.exp(self.eval_loss) if self.eval_loss < 50 else float("inf")


def train_one(
    name: str,
    model: PreTrainedModel,
    train_dataset,
    eval_dataset,
    output_dir: Path,
    settings: TrainSettings,
    tokenizer=None,
    resume_from_checkpoint: str | bool | None = None,
    trainer_class: Callable[..., Trainer] = DepthFusionTrainer,
    analyse: Callable[[PreTrainedModel], object] | None = None,
    overwrite: bool = False,
    run_record: dict | None = None,
) -> RunResult:
    """Train ``model`` with the ``Trainer``, evaluate it, and save a remote-code folder to ``output_dir/final``.

    ``output_dir/final`` must be missing, empty or a previous export of this package (see
    ``remote_code.save_remote_code_folder``); check it with ``safe_folder.check_target`` before training.
    ``overwrite``: write ``final`` beside foreign entries and replace edited files the export writes again
    (``save_remote_code_folder``'s rule; a warning names them).
    ``trainer_class`` builds the trainer from ``model``, ``args``, ``train_dataset`` and ``eval_dataset`` keywords
    (a ``DepthFusionTrainer`` subclass or a ``functools.partial`` adding callbacks; see ``recipes/study/``).
    ``analyse`` is called on the main process with the trained, unsharded model (under FSDP / DeepSpeed the
    gathered copy that is saved), e.g. for the family's analysis plot.
    ``resume_from_checkpoint``: a complete checkpoint folder (see ``checkpoints.resolve_checkpoint``; ``True``
    lets the Trainer pick one, without the completeness check). Every checkpoint written holds the tokenizer and
    the model config (and ``run_record``, see ``checkpoints.CheckpointExtras``); a save that fails on a full disk
    raises ``OSError(ENOSPC)`` naming the folder.
    """
    args = training_arguments(output_dir, settings)
    trainer = trainer_class(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset)
    trainer.add_callback(CheckpointExtras(tokenizer, model.config, run_record))  # every checkpoint holds them
    warn_if_sharding_dropped(trainer)
    start = time.perf_counter()
    try:
        train_output = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    except Exception as error:
        full = full_disk_error(error, output_dir)
        if full is not None:
            raise full from error
        raise
    seconds = train_output.metrics.get("train_runtime", time.perf_counter() - start)
    metrics = trainer.evaluate()
    # Steps this call ran (fewer than max_steps after a resume; the Trainer records where it started).
    steps_run = trainer.state.global_step - getattr(trainer, "_initial_global_step", 0)
    tokens = steps_run * settings.batch_size * settings.gradient_accumulation_steps
    tokens *= len(train_dataset[0]["input_ids"]) * max(1, args.world_size)
    to_save = unsharded_model(trainer, model)
    if trainer.is_world_process_zero():
        # a remote-code folder (the Llama baseline: a plain one), marked; never replaces what we did not write
        try:
            save_remote_code_folder(to_save, output_dir / "final", tokenizer=tokenizer, overwrite=overwrite)
        except Exception as error:
            full = full_disk_error(error, output_dir)
            if full is not None:
                raise full from error
            raise
        if analyse is not None:
            analyse(to_save)
    return RunResult(
        name=name,
        model_type=model.config.model_type,
        # DeepSpeed ZeRO-3 leaves empty local partitions; `ds_numel` is the full size.
        parameters=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
        eval_loss=float(metrics["eval_loss"]),
        train_loss=float(train_output.training_loss),
        train_seconds=float(seconds),
        tokens_per_second=tokens / max(float(seconds), 1e-9),
        log_history=trainer.state.log_history,
    )


def warn_if_sharding_dropped(trainer: Trainer) -> None:
    """Warn when ``accelerate launch`` asked for FSDP but the Trainer runs without it.

    accelerate 1.15 classifies processes without a GPU as ``MULTI_CPU`` and then drops the FSDP plugin of the
    launch config without a word, so an FSDP config on a CPU-only machine trains with plain DDP (every rank
    holds the whole model). The numbers are still right; the memory is not what the user asked for.
    """
    fsdp_launch = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")  # accelerate launch's flag
    if fsdp_launch and not trainer.is_fsdp_enabled:
        warnings.warn(
            "accelerate was launched with an FSDP config but the Trainer runs without FSDP (accelerate runs FSDP "
            "configs as DDP on machines without GPUs): every rank holds the full model. Use "
            "configs/accelerate/cpu_ddp.yaml on CPU to say so, or a GPU machine for FSDP.",
            stacklevel=2,
        )


def unsharded_model(trainer: Trainer, model: PreTrainedModel) -> PreTrainedModel | None:
    """``model`` itself, or under FSDP / DeepSpeed an unsharded copy holding the gathered weights (on rank 0).

    Every rank must call this (the gather is a collective); other ranks get ``None`` when a copy is made.
    Without FSDP or DeepSpeed (one process, DDP) nothing is gathered and ``model`` comes back on every rank.
    Tested under FSDP2 on 2 CPU processes (``tests/training/test_fsdp.py``: the export holds every trained tensor
    and gives the trained model's logits).
    """
    if not (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled):
        return model
    state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # full tensors on rank 0 only
    if not trainer.is_world_process_zero():
        return None
    copy = type(model)(model.config)
    missing, unexpected = copy.load_state_dict(state_dict, strict=False)
    tied = set(getattr(copy, "all_tied_weights_keys", {}) or {})
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"gathered state dict does not fit {type(model).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    copy.tie_weights()
    return copy


def results_table(results: list[RunResult]) -> str:
    """A markdown table: validation loss, perplexity, parameters, train tokens/s, and ratios to the last row."""
    base = results[-1]
    rows = [[r.name, f"{r.eval_loss:.4f}", f"{r.perplexity:.2f}", f"{r.parameters:,}", f"{r.tokens_per_second:,.0f}",
             f"{r.eval_loss - base.eval_loss:+.4f}", f"{r.tokens_per_second / base.tokens_per_second:.3f}×"]
            for r in results]
    return "\n".join(table_lines(["model", "val loss", "val ppl", "params", "train tokens/s", "Δ loss vs baseline",
                                   "speed vs baseline"], rows))


__all__ = ["DepthFusionTrainer", "GATED_MODA_NEW_PARAM_LR_SCALE", "RECOMMENDED_NEW_PARAM_LR_SCALE",
           "RunResult", "TrainSettings", "baseline_arch", "build_config", "build_model", "family_kwargs",
           "get_last_checkpoint", "is_main_process", "load_arch", "recommended_new_param_lr_scale", "results_table",
           "start_from_seeded_llama", "train_one", "training_arguments", "unsharded_model"]
