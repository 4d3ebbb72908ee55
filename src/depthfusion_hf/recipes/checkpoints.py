"""Training checkpoints of the causal-LM recipe: which are complete, what they hold, and resuming them safely.

A ``checkpoint-N`` folder written by the ``Trainer`` counts as complete when everything a resume reads is there
and readable: the model weights (``model.safetensors``, a sharded index and its shards, or FSDP's sharded
``pytorch_model_fsdp_*/``), the optimizer and scheduler states, a parseable ``trainer_state.json``, the model's
``config.json`` and its tokenizer (both written into every checkpoint by :class:`CheckpointExtras`; FSDP's
sharded checkpoints hold no ``config.json`` of their own). A job killed while saving, or a disk that filled up,
leaves an incomplete folder; :func:`get_last_checkpoint` skips such folders with a warning naming them.

A resume must continue the checkpoint's model with the checkpoint's tokenizer: :func:`resume_config` returns the
checkpoint's config once the command line agrees with it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, TrainerCallback

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Config fields that are no part of the architecture: bookkeeping, runtime choices and training-time defaults.
NOT_ARCHITECTURE = frozenset(PretrainedConfig.__dataclass_fields__) | {"use_cache", "op_backend", "initializer_range"}
# What a run takes from its tokenizer, not from the model config file.
TOKENIZER_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
# The run record in every checkpoint (see CheckpointExtras), and the settings in it a resume must repeat.
RUN_FILE = "depthfusion_run.json"
RUN_SETTINGS = ("init_from", "new_param_lr_scale")
# Below this many free bytes on the output's disk, a failed save is reported as a full disk.
FULL_DISK_BYTES = 16 * 2**20


def _zip_problem(path: Path) -> str | None:
    """``torch.save`` writes a zip archive, whose directory is at its end: a truncated file has none."""
    if not path.is_file():
        return f"no {path.name}"
    return None if zipfile.is_zipfile(path) else f"{path.name} is truncated or not a torch.save file"


def _json_problem(path: Path) -> str | None:
    if not path.is_file():
        return f"no {path.name}"
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        return f"{path.name} is not valid JSON ({error})"
    return None


def _safetensors_problem(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt"):  # reads the header; a file shorter than its header says is refused
            return None
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types (SafetensorError, OSError)
        return f"{path.name} is unreadable ({error})"


def _sharded_problem(folders: list[Path]) -> str | None:
    """torch.distributed.checkpoint writes a folder's ``.metadata`` last: a folder without it is incomplete."""
    return next((f"{f.name}/ has no .metadata (written last)" for f in folders if not (f / ".metadata").is_file()),
                None)


def _weights_problem(folder: Path) -> str | None:
    if (folder / "model.safetensors").is_file():
        return _safetensors_problem(folder / "model.safetensors")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        problem = _json_problem(index)
        if problem:
            return problem
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        return next((p for p in (_safetensors_problem(folder / shard) if (folder / shard).is_file()
                                 else f"no {shard}" for shard in shards) if p), None)
    sharded = sorted(folder.glob("pytorch_model_fsdp_*"))  # FSDP SHARDED_STATE_DICT (torch.distributed.checkpoint)
    if sharded:
        return _sharded_problem(sharded)
    if (folder / "pytorch_model.bin").is_file():
        return _zip_problem(folder / "pytorch_model.bin")
    return "no model weights (model.safetensors, a sharded index or pytorch_model_fsdp_*/)"


def _optimizer_problem(folder: Path) -> str | None:
    if (folder / "optimizer.pt").is_file():
        return _zip_problem(folder / "optimizer.pt")
    sharded = sorted(p for p in folder.glob("optimizer_*") if p.is_dir())  # FSDP
    if sharded:
        return _sharded_problem(sharded)
    if any(folder.glob("rank*-of-*-optimizer.pt")) or any(folder.glob("global_step*")):  # per-rank / DeepSpeed
        return None
    return "no optimizer state (optimizer.pt)"


def checkpoint_problems(folder: str | Path, tokenizer: bool = True) -> list[str]:
    """What a resume from ``folder`` would miss or fail to read; ``[]`` for a complete checkpoint.

    Args:
        tokenizer: count a missing tokenizer (``False`` when the run is given one, e.g. for a checkpoint written
            before checkpoints held it).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    problems = [_weights_problem(folder), _optimizer_problem(folder), _zip_problem(folder / "scheduler.pt"),
                _json_problem(folder / "trainer_state.json"), _json_problem(folder / "config.json")]
    tokenizer_file = folder / "tokenizer_config.json"
    if tokenizer and not tokenizer_file.is_file():
        problems.append("no tokenizer_config.json (interrupted, or written before checkpoints held the tokenizer: "
                        "then pass --tokenizer with the one it was trained with)")
    elif tokenizer_file.is_file():
        problems.append(_json_problem(tokenizer_file))
    return [problem for problem in problems if problem]


def get_last_checkpoint(output_dir: str | Path, tokenizer: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` folder in ``output_dir`` (None when there is none or no folder).

    Incomplete ones (see :func:`checkpoint_problems`, which ``tokenizer`` is passed to) are skipped with a
    warning naming each and what it lacks.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    for _, folder in sorted(found, reverse=True):
        problems = checkpoint_problems(folder, tokenizer)
        if not problems:
            return str(folder)
        warnings.warn(f"skipping incomplete checkpoint {folder}: {'; '.join(problems)}", stacklevel=2)
    return None


def resolve_checkpoint(request: str | None, output_dir: str | Path, tokenizer: bool = True) -> str | None:
    """The checkpoint folder a ``--resume_from_checkpoint`` value names: ``None``, ``"latest"`` (the newest complete
    one in ``output_dir``) or a folder, which must be complete (``tokenizer``: see :func:`checkpoint_problems`).

    Raises:
        ValueError: ``latest`` finds no complete checkpoint, or the folder given is incomplete (names what it lacks).
    """
    if request is None:
        return None
    if request == "latest":
        found = get_last_checkpoint(output_dir, tokenizer)
        if found is None:
            raise ValueError(f"No valid checkpoint found in {output_dir} (a complete checkpoint-N folder) to resume "
                             "from; start without --resume_from_checkpoint")
        return found
    problems = checkpoint_problems(request, tokenizer)
    if problems:
        raise ValueError(f"cannot resume from {request}: {'; '.join(problems)}")
    return str(request)


def checkpoint_tokenizer(folder: str | Path):
    """The tokenizer saved in a checkpoint, or ``None`` when it holds none (written before checkpoints held one)."""
    return AutoTokenizer.from_pretrained(folder) if (Path(folder) / "tokenizer_config.json").is_file() else None


def architecture_mismatches(first: PretrainedConfig, second: PretrainedConfig) -> dict[str, tuple]:
    """``{field: (first's value, second's value)}`` for the architecture fields (every config field but
    ``NOT_ARCHITECTURE``) where two configs of one class differ."""
    first_fields, second_fields = first.to_dict(), second.to_dict()
    names = [name for name in type(second).__dataclass_fields__ if name not in NOT_ARCHITECTURE]
    return {name: (first_fields.get(name), second_fields.get(name)) for name in names
            if first_fields.get(name) != second_fields.get(name)}


def resume_config(checkpoint: str | Path, kind: str, options: Mapping[str, object],
                  stated: Mapping[str, object] | None = None, stated_by: str = "") -> PretrainedConfig:
    """The config of the model in ``checkpoint``, once the command line is found to agree with it.

    A resume continues the checkpoint's model: fields the command line leaves out come from the checkpoint, and a
    field it gives must have the checkpoint's value (the Trainer would otherwise load the weights into another
    architecture of the same parameter names and shapes, e.g. a block AttnRes's into a full one).

    Args:
        kind: the ``--model`` of the command line.
        options: the family options given on the command line (``{field: value}``), each named ``--field``.
        stated: further fields the command line states (a ``--config`` file's, an ``--init_from`` Llama's),
            named ``stated_by`` in the error.
    Raises:
        ValueError: the checkpoint holds another ``model_type``, or a field disagrees (names each field, what
            states it, and both values).
    """
    from ..convert import source_config_fields

    found = AutoConfig.from_pretrained(checkpoint)
    if found.model_type != kind:
        raise ValueError(f"{checkpoint} holds a {found.model_type!r} model, but --model is {kind!r}")
    stated = dict(stated or {}) | dict(options)
    as_stated = type(found)(**(source_config_fields(found) | stated))
    mismatches = architecture_mismatches(as_stated, found)
    if mismatches:
        parts = [f"{f'--{name}' if name in options else stated_by} gives {name}={new!r}, the checkpoint has {old!r}"
                 for name, (new, old) in mismatches.items()]
        raise ValueError(f"{checkpoint} holds another architecture than this command line states: {'; '.join(parts)}. "
                         "A resume continues the checkpoint's model: leave these options out (the checkpoint's values "
                         "are used), or train a new model in another --output_dir")
    return found


def resume_run(checkpoint: str | Path, run: Mapping[str, object]) -> dict:
    """The run record to carry on from ``checkpoint``: ``run`` (see :class:`CheckpointExtras`) once its settings agree
    with the checkpoint's, its ``data`` the checkpoint's stretches plus this one's when the data differ (warned).

    A checkpoint written before checkpoints held the record is taken as it is (``run`` is returned).

    Raises:
        ValueError: a setting of ``RUN_SETTINGS`` differs (names each ``--option`` and both values): the Llama an
            upcycled run continues (its baseline starts from it) or the new parameters' rate (the optimizer's groups).
    """
    path = Path(checkpoint) / RUN_FILE
    if not path.is_file():
        return dict(run)
    saved = json.loads(path.read_text(encoding="utf-8"))
    wrong = [f"--{name} {run[name]!r}, the checkpoint's run had --{name} {saved.get(name)!r}" for name in RUN_SETTINGS
             if saved.get(name) != run[name]]
    if wrong:
        raise ValueError(f"{checkpoint} holds a run of other settings than this command line: {'; '.join(wrong)}. "
                         "Give the checkpoint's settings, or train a new model in another --output_dir")
    history = saved.get("data") or []
    if history[-1:] == list(run["data"]):
        return dict(run) | {"data": history}
    warnings.warn(f"resuming {checkpoint} on other data than it was trained on: {history[-1:]} then {run['data']} "
                  "(results.json records both as data_history)", stacklevel=2)
    return dict(run) | {"data": history + list(run["data"])}


class CheckpointExtras(TrainerCallback):
    """Writes the model config, the run record and the tokenizer into every checkpoint the ``Trainer`` saves (on the
    main process; the tokenizer last: ``tokenizer_config.json`` marks the checkpoint complete).

    The ``Trainer`` saves neither the tokenizer (unless it was given one as ``processing_class``, which also changes
    its data collator) nor, under FSDP's sharded state dicts, the config; a resume needs both. The run record
    (``RUN_FILE``: ``RUN_SETTINGS`` and ``data``, the data record of each stretch of training) is what a resume must
    keep or record (:func:`resume_run`).
    """

    def __init__(self, tokenizer, config: PretrainedConfig, run: Mapping[str, object] | None = None):
        self.tokenizer = tokenizer
        self.config = config
        self.run = run

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if not (folder / "config.json").is_file():
                self.config.save_pretrained(folder)
            if self.run is not None:
                (folder / RUN_FILE).write_text(json.dumps(self.run, indent=1), encoding="utf-8")
            if self.tokenizer is not None:
                save_tokenizer(self.tokenizer, folder)
        return control


def save_tokenizer(tokenizer, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)`` with ``tokenizer_config.json`` written last (transformers writes it
    first): a save cut short leaves a checkpoint without it, which counts as incomplete."""
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=folder))
    tokenizer.save_pretrained(staging)
    for path in sorted(staging.iterdir(), key=lambda path: path.name == "tokenizer_config.json"):
        os.replace(path, folder / path.name)
    staging.rmdir()


def full_disk_error(error: BaseException, folder: str | Path) -> OSError | None:
    """An ``OSError(ENOSPC)`` saying the disk holding ``folder`` is full, when ``error`` (or its cause) is one or the
    disk has less than ``FULL_DISK_BYTES`` free; else ``None``.

    torch.save reports a full disk as a ``RuntimeError`` about file positions and safetensors not at all, hence the
    free-space test.
    """
    chain, seen = error, set()
    full = False
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        full = full or (isinstance(chain, OSError) and chain.errno == errno.ENOSPC) or "No space left" in str(chain)
        chain = chain.__cause__ or chain.__context__
    existing = next((p for p in [Path(folder), *Path(folder).parents] if p.exists()), Path("."))
    free = shutil.disk_usage(existing).free
    if not (full or free < FULL_DISK_BYTES):
        return None
    return OSError(errno.ENOSPC, f"the disk holding {folder} is full ({free:,} bytes free) and a save failed "
                   f"({type(error).__name__}: {error}); free space, then resume with --resume_from_checkpoint latest "
                   "(incomplete checkpoints are skipped)")


__all__ = ["CheckpointExtras", "architecture_mismatches", "checkpoint_problems", "checkpoint_tokenizer",
           "full_disk_error", "get_last_checkpoint", "resolve_checkpoint", "resume_config", "resume_run"]
