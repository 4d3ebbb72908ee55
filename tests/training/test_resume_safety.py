"""A resume never changes the model or the vocabulary behind the user's back (issue 19 §2).

- A resume continues the checkpoint's architecture (``--attnres_block_size 2`` forgotten must not load block-2
  weights into a full AttnRes), and refuses command-line options that disagree with it, naming them.
- Every checkpoint holds the tokenizer (and the config); a resume reuses it, also after a data change.
- ``latest`` counts complete checkpoints only and skips the others with a warning naming them; a full disk is
  reported as one.
- Resuming a tied-embedding model does not log "missing keys: ['lm_head.weight']".
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from depthfusion_hf import AttnResConfig, DenseFormerConfig, MoDAConfig
from depthfusion_hf.recipes import checkpoints
from depthfusion_hf.recipes.checkpoints import (
    checkpoint_problems,
    full_disk_error,
    get_last_checkpoint,
    resolve_checkpoint,
    resume_config,
)
from depthfusion_hf.recipes.records import file_sha256

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import train_clm  # noqa: E402

ARCH = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def arch_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("arch") / "arch.json"
    path.write_text(json.dumps(ARCH))
    return path


def run_args(arch_file: Path, corpus_file: Path, out: Path, steps: int = 4) -> list[str]:
    """A tiny AttnRes run: 2 layers of width 32, ``steps`` steps of 2 blocks of 32 tokens, a checkpoint every 2."""
    return ["--model", "attnres", "--config", str(arch_file), "--max_steps", str(steps), "--save_steps", "2",
            "--eval_steps", "0", "--logging_steps", "1", "--batch_size", "2", "--block_size", "32",
            "--max_train_blocks", "16", "--max_eval_blocks", "2", "--vocab_size", "300", "--no_baseline",
            "--train_files", str(corpus_file), "--validation_fraction", "0.1", "--output_dir", str(out)]


@pytest.fixture(scope="module")
def block2_run(tmp_path_factory, arch_file, corpus_file):
    """The reference: 4 uninterrupted steps of a block-2 AttnRes, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("block2")
    results = train_clm.main(run_args(arch_file, corpus_file, out) + ["--attnres_block_size", "2"])
    return out, results


def copy_checkpoint(run_out: Path, step: int, out: Path) -> Path:
    target = out / "attnres" / f"checkpoint-{step}"
    shutil.copytree(run_out / "attnres" / f"checkpoint-{step}", target)
    return target


class Records(logging.Handler):
    """Collects the messages of a logger (transformers' loggers do not propagate to pytest's caplog)."""

    def __init__(self, name: str):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.logger = logging.getLogger(name)

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def test_every_checkpoint_holds_the_tokenizer_and_the_config(block2_run):
    out, _ = block2_run
    final = AutoTokenizer.from_pretrained(out / "attnres" / "final")
    for step in (2, 4):
        folder = out / "attnres" / f"checkpoint-{step}"
        assert checkpoint_problems(folder) == []
        assert AutoTokenizer.from_pretrained(folder).get_vocab() == final.get_vocab()
        assert AutoConfig.from_pretrained(folder).attnres_block_size == 2


def test_a_resume_without_the_family_option_continues_the_checkpoints_architecture(block2_run, tmp_path, arch_file,
                                                                                    corpus_file):
    ref_out, reference = block2_run
    copy_checkpoint(ref_out, 2, tmp_path)
    with Records("transformers.trainer") as log:
        resumed = train_clm.main(run_args(arch_file, corpus_file, tmp_path) + ["--resume_from_checkpoint", "latest"])
    (run,) = resumed["runs"]
    assert run["name"] == "attnres block 2"  # before: "attnres full", the block-2 weights in a full AttnRes
    assert run["eval_loss"] == pytest.approx(reference["runs"][0]["eval_loss"], rel=1e-5)
    assert AutoConfig.from_pretrained(tmp_path / "attnres" / "final").attnres_block_size == 2
    assert not [m for m in log.messages if "missing keys" in m]  # the tied lm_head is no missing key
    # the record names the data actually used, by name and hash
    assert resumed["data"]["source"] == "files"
    assert resumed["data"]["files"] == [{"name": corpus_file.name, "sha256": file_sha256(corpus_file)}]


@pytest.mark.parametrize("extra,message", [
    (["--attnres_block_size", "3"], "--attnres_block_size gives attnres_block_size=3, the checkpoint has 2"),
    (["--attnres_block_size", "full"], "--attnres_block_size gives attnres_block_size=None, the checkpoint has 2"),
    (["--model", "moda"], "holds a 'attnres' model, but --model is 'moda'"),
])
def test_a_resume_with_a_disagreeing_option_is_refused_naming_it(block2_run, tmp_path, arch_file, corpus_file,
                                                                 extra, message):
    checkpoint = copy_checkpoint(block2_run[0], 2, tmp_path)
    with pytest.raises(ValueError, match=message):
        train_clm.main(run_args(arch_file, corpus_file, tmp_path / "run") + extra
                       + ["--resume_from_checkpoint", str(checkpoint)])
    assert not (tmp_path / "run" / "attnres" / "final").exists()


def test_a_resume_with_a_config_file_that_disagrees_is_refused_naming_the_fields(block2_run, tmp_path, corpus_file):
    checkpoint = copy_checkpoint(block2_run[0], 2, tmp_path)
    other = tmp_path / "wider.json"
    other.write_text(json.dumps(ARCH | {"hidden_size": 48, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=rf"--config {other} gives hidden_size=48, the checkpoint has 32") as info:
        train_clm.main(run_args(other, corpus_file, tmp_path / "run") + ["--resume_from_checkpoint", str(checkpoint)])
    assert "intermediate_size=96" in str(info.value)


FAMILY_OPTIONS = {
    DenseFormerConfig: {"dwa_dilation": [1, 2], "dwa_period": [1, 2]},
    MoDAConfig: {"norm_position": ["pre", "post"], "moda_ffn_kv": [True, False], "moda_depth_window": [None, 1]},
    AttnResConfig: {"attnres_block_size": [None, 1, 2, 3]},
}


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_resume_config_keeps_every_family_option_and_refuses_each_disagreement(data):
    """For every family option: a checkpoint's value is kept when the command line leaves it out or repeats it, and a
    different value is refused naming ``--option`` (MoDA's forgotten ``--norm_position post`` included)."""
    cls = data.draw(st.sampled_from(sorted(FAMILY_OPTIONS, key=lambda c: c.model_type)))
    values = {name: data.draw(st.sampled_from(choices)) for name, choices in FAMILY_OPTIONS[cls].items()}
    with tempfile.TemporaryDirectory() as folder:
        cls(**ARCH, vocab_size=300, **values).save_pretrained(folder)
        kept = resume_config(folder, cls.model_type, {})
        assert all(getattr(kept, name) == value for name, value in values.items())
        name = data.draw(st.sampled_from(sorted(values)))
        assert getattr(resume_config(folder, cls.model_type, {name: values[name]}), name) == values[name]
        other = data.draw(st.sampled_from([v for v in FAMILY_OPTIONS[cls][name] if v != values[name]]))
        with pytest.raises(ValueError, match=rf"--{name} gives {name}={other!r}, the checkpoint has {values[name]!r}"):
            resume_config(folder, cls.model_type, {name: other})


def test_a_resume_after_a_data_change_reuses_the_checkpoints_tokenizer(block2_run, tmp_path, arch_file, corpus_file):
    ref_out, _ = block2_run
    checkpoint = copy_checkpoint(ref_out, 2, tmp_path)
    changed = tmp_path / "changed.txt"  # other text: a BPE trained on it has another vocabulary
    changed.write_text(corpus_file.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    train_clm.main(run_args(arch_file, changed, tmp_path) + ["--resume_from_checkpoint", "latest"])
    saved = AutoTokenizer.from_pretrained(checkpoint).get_vocab()
    assert AutoTokenizer.from_pretrained(tmp_path / "attnres" / "final").get_vocab() == saved
    assert AutoTokenizer.from_pretrained(checkpoint.parent / "checkpoint-4").get_vocab() == saved


def test_a_tokenizer_other_than_the_checkpoints_is_refused(block2_run, tmp_path, arch_file, corpus_file):
    checkpoint = copy_checkpoint(block2_run[0], 2, tmp_path)
    from depthfusion_hf.data.corpus import train_bpe_tokenizer

    other = train_bpe_tokenizer(["some other text entirely"] * 20, 300)
    other.save_pretrained(tmp_path / "other_tokenizer")
    with pytest.raises(ValueError, match="has another vocabulary .* than the checkpoint .*'s own tokenizer"):
        train_clm.main(run_args(arch_file, corpus_file, tmp_path / "run") + [
            "--tokenizer", str(tmp_path / "other_tokenizer"), "--resume_from_checkpoint", str(checkpoint)])
    (checkpoint / "tokenizer_config.json").unlink()  # an old checkpoint without a tokenizer: say what to pass
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"no tokenizer_config.json .* pass --tokenizer"):
        train_clm.main(run_args(arch_file, corpus_file, tmp_path / "run") + ["--resume_from_checkpoint",
                                                                             str(checkpoint)])


# --- complete checkpoints only --------------------------------------------------------------------------------

FILES = ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "config.json",
         "tokenizer_config.json"]


def damage(folder: Path, name: str, how: str, keep: float) -> None:
    path = folder / name
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: int(keep * (len(data) - 2))])
    else:  # overwritten with bytes that are no such file
        path.write_bytes(b"\x00garbage" * 3)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(name=st.sampled_from(FILES), how=st.sampled_from(["delete", "truncate", "garbage"]),
       keep=st.floats(0.0, 0.9))
def test_latest_skips_a_damaged_checkpoint_with_a_warning_naming_it(block2_run, name, how, keep):
    with tempfile.TemporaryDirectory() as root:
        out = Path(root)
        good, bad = copy_checkpoint(block2_run[0], 2, out), copy_checkpoint(block2_run[0], 4, out)
        damage(bad, name, how, keep)
        with pytest.warns(UserWarning, match=rf"skipping incomplete checkpoint {bad}: .*{name}"):
            assert get_last_checkpoint(out / "attnres") == str(good)
        with pytest.raises(ValueError, match=rf"cannot resume from {bad}: .*{name}"):
            resolve_checkpoint(str(bad), out / "attnres")


def test_latest_picks_the_newest_complete_checkpoint_without_a_warning(block2_run):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_last_checkpoint(block2_run[0] / "attnres") == str(block2_run[0] / "attnres" / "checkpoint-4")


def test_a_resume_skips_a_checkpoint_killed_before_its_optimizer_state(block2_run, tmp_path, arch_file, corpus_file):
    """Before, ``latest`` took checkpoint-4 and the Trainer silently went on without its optimizer state."""
    ref_out, reference = block2_run
    copy_checkpoint(ref_out, 2, tmp_path)
    killed = copy_checkpoint(ref_out, 4, tmp_path)
    state = json.loads((killed / "trainer_state.json").read_text())
    for entry in state["log_history"]:  # tag what checkpoint-4 holds: a right resume recomputes steps 3 and 4
        entry["from_checkpoint"] = True
    (killed / "trainer_state.json").write_text(json.dumps(state))
    (killed / "optimizer.pt").unlink()
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint .*checkpoint-4: no optimizer state"):
        resumed = train_clm.main(run_args(arch_file, corpus_file, tmp_path) + ["--resume_from_checkpoint", "latest"])
    steps = {h["step"]: h for h in resumed["runs"][0]["log_history"] if "loss" in h}
    expected = {h["step"]: h["loss"] for h in reference["runs"][0]["log_history"] if "loss" in h}
    for step in (3, 4):
        assert not steps[step].get("from_checkpoint") and steps[step]["loss"] == pytest.approx(expected[step], rel=1e-5)


def test_a_full_disk_is_reported_as_a_full_disk_and_its_checkpoint_is_skipped(tmp_path, arch_file, corpus_file,
                                                                               monkeypatch):
    real_save = torch.save

    def full_disk_save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(OSError, match=r"the disk holding .* is full") as info:
        train_clm.main(run_args(arch_file, corpus_file, tmp_path, steps=2))
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(torch, "save", real_save)
    with pytest.warns(UserWarning, match="checkpoint-2: no optimizer state"):
        with pytest.raises(ValueError, match="No valid checkpoint found"):
            train_clm.main(run_args(arch_file, corpus_file, tmp_path, steps=2) + ["--resume_from_checkpoint", "latest"])


def test_full_disk_error_reads_errno_messages_and_free_space(tmp_path, monkeypatch):
    assert full_disk_error(OSError(errno.ENOSPC, "x"), tmp_path).errno == errno.ENOSPC
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert full_disk_error(wrapped, tmp_path) is not None
    assert full_disk_error(RuntimeError("unexpected pos 704 vs 598"), tmp_path) is None  # plenty of space here
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    # torch.save's own message for a full disk says nothing about space: the free space does
    error = full_disk_error(RuntimeError("unexpected pos 704 vs 598"), tmp_path / "missing" / "folder")
    assert error is not None and "(0 bytes free)" in str(error)


def test_a_real_missing_key_still_warns_after_a_resume(tmp_path):
    from transformers import TrainingArguments

    from depthfusion_hf.recipes.clm import DepthFusionTrainer

    model = train_clm.build_model("denseformer", dict(ARCH, vocab_size=50))
    trainer = DepthFusionTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none",
                                                                    use_cpu=True))
    state = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "model.norm.weight")}
    with Records("transformers.trainer") as log:
        trainer._issue_warnings_after_load(model.load_state_dict(state, strict=False))
    assert [m for m in log.messages if "missing keys" in m] == [
        "There were missing keys in the checkpoint model loaded: ['model.norm.weight']."]


def test_resume_config_compares_an_upcycled_checkpoint_with_its_llama(tmp_path):
    """With --init_from, the Llama states every field (its vocabulary included)."""
    from transformers import LlamaForCausalLM

    from depthfusion_hf.convert import llama_to_denseformer, source_config_fields

    llama = LlamaForCausalLM(LlamaConfig(**ARCH, vocab_size=120))
    llama_to_denseformer(llama, dwa_dilation=2).save_pretrained(tmp_path / "ckpt")
    fields = source_config_fields(llama.config)
    config = resume_config(tmp_path / "ckpt", "denseformer", {}, fields, "--init_from L")
    assert (config.dwa_dilation, config.vocab_size) == (2, 120)
    other = source_config_fields(LlamaConfig(**(ARCH | {"hidden_size": 48}), vocab_size=121))
    with pytest.raises(ValueError, match="--init_from L gives hidden_size=48, the checkpoint has 32") as info:
        resume_config(tmp_path / "ckpt", "denseformer", {}, other, "--init_from L")
    assert "vocab_size=121, the checkpoint has 120" in str(info.value)


def test_a_baseline_checkpoint_of_another_llama_is_refused(tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**ARCH, vocab_size=120)).save_pretrained(tmp_path / "ckpt")
    baseline = LlamaForCausalLM(LlamaConfig(**(ARCH | {"num_hidden_layers": 3}), vocab_size=120))
    with pytest.raises(ValueError, match="holds another Llama than this run's baseline: num_hidden_layers: this run 3"):
        train_clm.check_baseline_checkpoint(str(tmp_path / "ckpt"), baseline)


# --- what the run was: the Llama it upcycled, the new parameters' rate, the data of each stretch ----------------

def tiny_llama(folder: Path) -> Path:
    """A random 2-layer Llama of ARCH's shape saved with its own BPE tokenizer (300 tokens)."""
    from transformers import LlamaForCausalLM

    from depthfusion_hf.data.corpus import load_documents, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(load_documents()[:40], 300)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**ARCH, vocab_size=300, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                     ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def upcycled_run(tmp_path_factory, arch_file, corpus_file):
    """An AttnRes upcycled from a tiny Llama, its new parameters at 10x the rate: 2 steps, a checkpoint at 2."""
    root = tmp_path_factory.mktemp("upcycled")
    llama = tiny_llama(root / "llama")
    upcycle = ["--init_from", str(llama), "--new_param_lr_scale", "10"]
    train_clm.main(run_args(arch_file, corpus_file, root / "run", steps=2) + upcycle)
    return root / "run", upcycle


@pytest.mark.parametrize("change,message", [
    (lambda upcycle: [], "--init_from None, the checkpoint's run had --init_from .*llama"),
    (lambda upcycle: upcycle[:2] + ["--new_param_lr_scale", "3"],
     "--new_param_lr_scale 3.0, the checkpoint's run had --new_param_lr_scale 10.0"),
])
def test_a_resume_of_an_upcycled_run_keeps_its_llama_and_rate(upcycled_run, tmp_path, arch_file, corpus_file, change,
                                                             message):
    """Before, leaving --init_from out trained the baseline from a random Llama instead of the upcycled one (and a
    changed --new_param_lr_scale failed deep in the optimizer's state, or was silently replaced by the saved rates)."""
    run_out, upcycle = upcycled_run
    shutil.copytree(run_out / "attnres", tmp_path / "attnres")
    with pytest.raises(ValueError, match=rf"holds a run of other settings than this command line: {message}"):
        train_clm.main(run_args(arch_file, corpus_file, tmp_path, steps=3) + change(upcycle)
                       + ["--resume_from_checkpoint", "latest"])
    resumed = train_clm.main(run_args(arch_file, corpus_file, tmp_path, steps=3) + upcycle
                             + ["--resume_from_checkpoint", "latest"])
    assert max(h["step"] for h in resumed["runs"][0]["log_history"]) == 3


def test_a_resume_on_other_data_records_each_stretch(block2_run, tmp_path, arch_file, corpus_file):
    """Before, the record named only the data of the last stretch (the model card: trained on that alone)."""
    copy_checkpoint(block2_run[0], 2, tmp_path)
    changed = tmp_path / "changed.txt"
    changed.write_text(corpus_file.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    with pytest.warns(UserWarning, match="resuming .*checkpoint-2 on other data than it was trained on"):
        resumed = train_clm.main(run_args(arch_file, changed, tmp_path) + ["--resume_from_checkpoint", "latest"])
    assert [d["files"][0]["name"] for d in resumed["data_history"]] == [corpus_file.name, changed.name]
    assert resumed["data"] == resumed["data_history"][-1]
    saved = json.loads((tmp_path / "attnres" / "checkpoint-4" / checkpoints.RUN_FILE).read_text())
    assert saved["data"] == resumed["data_history"]  # a further resume keeps the whole history


def test_a_checkpoint_whose_tokenizer_save_was_cut_short_is_incomplete(block2_run, tmp_path, monkeypatch):
    """transformers writes tokenizer_config.json (the mark of a complete checkpoint) before tokenizer.json: a job killed
    in between left a 'complete' checkpoint that the resume could not load ("Couldn't instantiate the backend
    tokenizer"), and ``latest`` did not fall back to the one before."""
    from types import SimpleNamespace

    from transformers import TrainerControl

    checkpoint = copy_checkpoint(block2_run[0], 4, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for name in ("tokenizer_config.json", "tokenizer.json"):
        (checkpoint / name).unlink()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the job stops after tokenizer_config.json was written

    monkeypatch.setattr(type(tokenizer), "_save_pretrained", killed)
    extras = checkpoints.CheckpointExtras(tokenizer, AutoConfig.from_pretrained(checkpoint))
    with pytest.raises(KeyboardInterrupt):
        extras.on_save(SimpleNamespace(output_dir=str(tmp_path / "attnres")),
                       SimpleNamespace(is_world_process_zero=True, global_step=4), TrainerControl())
    assert any("tokenizer_config.json" in problem for problem in checkpoint_problems(checkpoint))
    monkeypatch.undo()
    extras.on_save(SimpleNamespace(output_dir=str(tmp_path / "attnres")),
                   SimpleNamespace(is_world_process_zero=True, global_step=4), TrainerControl())
    assert checkpoint_problems(checkpoint) == []
    assert AutoTokenizer.from_pretrained(checkpoint).get_vocab() == tokenizer.get_vocab()
