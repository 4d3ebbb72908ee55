"""Engineer D2's probe of issue 19 (§2-§5, §7 command line): 175 cases over resume and checkpoints, upcycling,
conversions, records, config fields and train_clm values, run against one checkout (not a pytest file: it is
run by hand against a before and an after checkout, and prints one line per case):

    PYTHONPATH=<root>/src python scripts/probes/probe_issue19.py <root> <out.json> [group,group,...]

e.g. ``<root>`` = ``/work/before`` (the session's starting code) or the repository root. Each case's outcome: ok
(the right result, or an error naming what is wrong), silent (a wrong result without an error, or an impossible
value accepted), loss (a user's file replaced or deleted), traceback (an error that does not name the option /
field / file: a bare KeyError, AssertionError, JSONDecodeError, ...), misleading (a warning that is noise).
Recorded results: docs/RELIABILITY.md section 7 (before: 97 silent, 2 losses, 51 tracebacks, 1 misleading, 24 ok;
after: 175 ok).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
from huggingface_hub import ModelCard

ROOT = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(ROOT / "scripts"))
warnings.simplefilter("ignore")
logging.disable(logging.INFO)

import train_clm  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig  # noqa: E402

from depthfusion_hf import (  # noqa: E402
    AttnResConfig,
    DenseFormerConfig,
    MoDAConfig,
    convert,  # noqa: E402
)
from depthfusion_hf.data.corpus import load_documents, train_bpe_tokenizer  # noqa: E402
from depthfusion_hf.model_card import build_model_card, clm_results  # noqa: E402


def split_front_matter(text: str) -> tuple[dict, str]:
    card = ModelCard(text)
    return card.data.to_dict(), card.text

transformers.logging.set_verbosity_error()
WORK = Path(tempfile.mkdtemp(prefix="d2probe_"))
RESULTS: list[dict] = []
CLASSES = {"denseformer": DenseFormerConfig, "moda": MoDAConfig, "attnres": AttnResConfig}
TINY = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)


def record(group: str, name: str, outcome: str, detail: str = "") -> None:
    RESULTS.append({"group": group, "case": name, "outcome": outcome, "detail": detail[:300]})
    print(f"{outcome:10s} {group:9s} {name}  {detail[:140]}", flush=True)


def expect_error(group: str, name: str, run, names: tuple[str, ...], check_ok=None) -> None:
    """The case must raise an error whose message names one of ``names``; no error: ``check_ok(result)`` decides
    ok (True) or silent."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            result = run()
    except SystemExit as exit_:
        message = err.getvalue()
        outcome = "ok" if exit_.code == 2 and any(n in message for n in names) else "traceback"
        record(group, name, outcome, message.strip().splitlines()[-1] if message.strip() else f"exit {exit_.code}")
        return
    except Exception as error:  # noqa: BLE001
        message = f"{type(error).__name__}: {error}"
        named = isinstance(error, (ValueError, OSError)) and any(n in str(error) for n in names)
        record(group, name, "ok" if named else "traceback", message)
        return
    verdict = check_ok(result) if check_ok is not None else False
    record(group, name, "ok" if verdict else "silent", "no error" if not verdict else "handled")


# ---------------------------------------------------------------------------------------------------------------
# Config fields: construction, then a model and a forward pass when accepted
# ---------------------------------------------------------------------------------------------------------------

def forward_ok(config) -> bool:
    """An accepted config is right only when its model computes finite logits in training mode too."""
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.tensor([[1, 2, 3, 4]])
    model.train()
    logits = model(ids).logits
    return bool(torch.isfinite(logits).all())


OWN_TYPOS = {"denseformer": ["dwa_dilaton", "dwa_periode", "op_backnd"],
             "moda": ["moda_ffn_kvv", "norm_positon", "op_backnd"],
             "attnres": ["attnres_blocksize", "attnres_block_sise", "op_backnd"]}
FOREIGN = {"denseformer": ["moda_ffn_kv", "attnres_block_size"], "moda": ["dwa_dilation", "attnres_block_size"],
           "attnres": ["dwa_period", "moda_depth_window"]}
BAD = [("rms_norm_eps", float("nan")), ("rms_norm_eps", float("inf")), ("rms_norm_eps", -1.0), ("rms_norm_eps", 0.0),
       ("rope_parameters", {"rope_type": "default", "rope_theta": -1.0}),
       ("rope_parameters", {"rope_type": "default", "rope_theta": 0.0}),
       ("rope_parameters", {"rope_type": "default", "rope_theta": float("nan")}), ("rope_theta", -1.0),
       ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": -1.0}),
       ("rope_parameters", {"rope_type": "foo", "rope_theta": 1e4}),
       ("hidden_act", "foo"), ("hidden_act", "SiLU"), ("pad_token_id", 50), ("pad_token_id", -1),
       ("bos_token_id", 50), ("eos_token_id", [2, 50]), ("max_position_embeddings", 0),
       ("attention_dropout", 1.5), ("dtype", "int8")]


def probe_configs() -> None:
    for kind, cls in CLASSES.items():
        for field, value in BAD:
            def run(field=field, value=value, cls=cls):
                return forward_ok(cls(**TINY, **{field: value}))
            name = f"{kind} {field}={value!r}"
            shown = "rope_parameters" if field == "rope_theta" else field
            expect_error("config", name, run, (f"`{shown}", f"`{field}"), check_ok=lambda c: False)
        for key in OWN_TYPOS[kind] + FOREIGN[kind]:
            expect_error("config", f"{kind} {key}=2 (misspelt / foreign option)",
                         lambda key=key, cls=cls: forward_ok(cls(**TINY, **{key: 2})), (f"`{key}`",),
                         check_ok=lambda c: False)


def probe_config_json() -> None:
    cases = [("rms_norm_eps", float("nan")), ("pad_token_id", 50), ("hidden_act", "foo"),
             ("rope_parameters", {"rope_type": "default", "rope_theta": -1.0})]
    for kind, cls in CLASSES.items():
        keys = [(field, value) for field, value in cases] + [(OWN_TYPOS[kind][0], 2), (FOREIGN[kind][0], 2)]
        for field, value in keys:
            folder = WORK / f"json_{kind}_{field}"
            folder.mkdir()
            fields = cls(**TINY).to_dict() | {field: value}
            (folder / "config.json").write_text(json.dumps(fields))

            def run(folder=folder):
                config = AutoConfig.from_pretrained(folder)
                return forward_ok(config) and False  # accepted at all: the value / key was not refused
            expect_error("json", f"{kind} config.json {field}={value!r}", run, (f"`{field}",))


# ---------------------------------------------------------------------------------------------------------------
# train_clm command line
# ---------------------------------------------------------------------------------------------------------------

CORPUS = WORK / "corpus.txt"
ARCH = WORK / "arch.json"


def tiny_run(out: Path, *extra: str, model: str = "attnres", steps: int = 1, corpus: Path | None = None) -> list[str]:
    return ["--model", model, "--config", str(ARCH), "--max_steps", str(steps), "--eval_steps", "0",
            "--logging_steps", "1", "--batch_size", "2", "--block_size", "32", "--max_train_blocks", "16",
            "--max_eval_blocks", "2", "--vocab_size", "300", "--no_baseline", "--train_files", str(corpus or CORPUS),
            "--validation_fraction", "0.1", "--output_dir", str(out), *extra]


def probe_cli() -> None:
    cases = [("--max_train_blocks", "0"), ("--max_train_blocks", "-1"), ("--gradient_accumulation_steps", "0"),
             ("--gradient_accumulation_steps", "-2"), ("--batch_size", "0"), ("--max_steps", "-5"),
             ("--learning_rate", "nan"), ("--learning_rate", "inf"), ("--learning_rate", "-1"),
             ("--weight_decay", "nan"), ("--weight_decay", "-0.1"), ("--warmup_ratio", "2"), ("--warmup_ratio", "-1"),
             ("--warmup_ratio", "nan"), ("--eval_steps", "-1"), ("--save_steps", "-1"), ("--logging_steps", "0"),
             ("--block_size", "1"), ("--block_size", "0"), ("--max_eval_blocks", "0"), ("--validation_fraction", "0"),
             ("--validation_fraction", "1.5"), ("--validation_fraction", "nan"), ("--vocab_size", "10"),
             ("--vocab_size", "0"), ("--seed", "-1"), ("--new_param_lr_scale", "nan"), ("--learning_rate", "0")]
    for i, (option, value) in enumerate(cases):
        out = WORK / f"cli_{i}"
        extra = [f"{option}={value}"]
        if option == "--new_param_lr_scale":
            extra += ["--init_from", str(WORK / "llama_tok")]
        expect_error("cli", f"{option} {value}", lambda out=out, extra=extra: train_clm.main(tiny_run(out, *extra)),
                     (option,))


def probe_config_files() -> None:
    files = {"not JSON": "hidden_size: 32", "a JSON array": "[1, 2]", "a trailing comma": '{"hidden_size": 32,}',
             "a misspelt Llama field": json.dumps(json.loads(ARCH.read_text()) | {"num_hiden_layers": 3}),
             "a misspelt family field": json.dumps(json.loads(ARCH.read_text()) | {"attnres_blocksize": 3})}
    for name, text in files.items():
        path = WORK / f"config_{len(RESULTS)}.json"
        path.write_text(text)
        args = tiny_run(WORK / f"cf_{len(RESULTS)}")
        args[args.index("--config") + 1] = str(path)
        expect_error("configfile", f"--config holding {name}", lambda args=args: train_clm.main(args),
                     ("--config", "num_hiden_layers", "attnres_blocksize"))
    for name, path in [("a folder", WORK), ("a missing file", WORK / "missing.json"),
                       ("moda_tiny.json with --model attnres", ROOT / "configs" / "moda_tiny.json")]:
        args = tiny_run(WORK / f"cf_{len(RESULTS)}")
        args[args.index("--config") + 1] = str(path)
        expect_error("configfile", f"--config {name}", lambda args=args: train_clm.main(args),
                     ("--config", "model_type 'moda'"))


# ---------------------------------------------------------------------------------------------------------------
# Resume and checkpoints
# ---------------------------------------------------------------------------------------------------------------

class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, rec):
        self.messages.append(rec.getMessage())


def final_config(out: Path, kind: str):
    return AutoConfig.from_pretrained(out / kind / "final")


def copy_ckpt(src: Path, out: Path, kind: str, step: int) -> Path:
    target = out / kind / f"checkpoint-{step}"
    shutil.copytree(src / kind / f"checkpoint-{step}", target)
    return target


def probe_resume() -> None:
    base = WORK / "base_attnres"
    reference = train_clm.main(tiny_run(base, "--attnres_block_size", "2", "--save_steps", "2", steps=4))
    ref_loss = reference["runs"][0]["eval_loss"]

    # R1 block size forgotten (+ the tied-embedding log)
    out = WORK / "r1"
    copy_ckpt(base, out, "attnres", 2)
    handler = Messages()
    logging.disable(logging.NOTSET)
    logging.getLogger("transformers.trainer").addHandler(handler)
    transformers.logging.set_verbosity_warning()
    try:
        expect_error("resume", "--attnres_block_size 2 forgotten on resume",
                     lambda: train_clm.main(tiny_run(out, "--save_steps", "2", "--resume_from_checkpoint", "latest",
                                                     steps=4)),
                     ("attnres_block_size",), check_ok=lambda r: final_config(out, "attnres").attnres_block_size == 2)
    finally:
        logging.getLogger("transformers.trainer").removeHandler(handler)
        transformers.logging.set_verbosity_error()
        logging.disable(logging.INFO)
    noisy = [m for m in handler.messages if "missing keys" in m]
    record("resume", "tied-embedding resume logs no missing lm_head", "misleading" if noisy else "ok",
           noisy[0] if noisy else "")

    # R2 a disagreeing option
    out = WORK / "r2"
    ckpt = copy_ckpt(base, out, "attnres", 2)
    expect_error("resume", "--attnres_block_size 3 given on a block-2 checkpoint",
                 lambda: train_clm.main(tiny_run(out, "--attnres_block_size", "3", "--save_steps", "2",
                                                 "--resume_from_checkpoint", str(ckpt), steps=4)),
                 ("--attnres_block_size",), check_ok=lambda r: False)

    # R3 MoDA post-norm without FFN-side K/V forgotten
    moda = WORK / "base_moda"
    train_clm.main(tiny_run(moda, "--norm_position", "post", "--no-moda_ffn_kv", "--save_steps", "2", model="moda",
                            steps=2))
    out = WORK / "r3"
    copy_ckpt(moda, out, "moda", 2)

    def moda_kept(_):
        config = final_config(out, "moda")
        return config.norm_position == "post" and config.moda_ffn_kv is False
    expect_error("resume", "MoDA --norm_position post --no-moda_ffn_kv forgotten on resume",
                 lambda: train_clm.main(tiny_run(out, "--save_steps", "2", "--resume_from_checkpoint", "latest",
                                                 model="moda", steps=4)),
                 ("norm_position", "moda_ffn_kv"), check_ok=moda_kept)

    # R4 DenseFormer 2x2 forgotten
    dense = WORK / "base_dense"
    train_clm.main(tiny_run(dense, "--dwa_dilation", "2", "--dwa_period", "2", "--save_steps", "2",
                            model="denseformer", steps=2))
    out = WORK / "r4"
    copy_ckpt(dense, out, "denseformer", 2)
    expect_error("resume", "DenseFormer --dwa_dilation 2 --dwa_period 2 forgotten on resume",
                 lambda: train_clm.main(tiny_run(out, "--save_steps", "2", "--resume_from_checkpoint", "latest",
                                                 model="denseformer", steps=4)),
                 ("dwa_dilation", "dwa_period"),
                 check_ok=lambda r: final_config(out, "denseformer").dwa_dilation == 2)

    # R5 data change on resume: the tokenizer must stay the checkpoint's
    out = WORK / "r5"
    copy_ckpt(base, out, "attnres", 2)
    changed = WORK / "changed.txt"
    changed.write_text(CORPUS.read_text(encoding="utf-8")[::-1], encoding="utf-8")
    original = AutoTokenizer.from_pretrained(base / "attnres" / "final").get_vocab()
    expect_error("resume", "data changed on resume: same tokenizer",
                 lambda: train_clm.main(tiny_run(out, "--save_steps", "2", "--resume_from_checkpoint", "latest",
                                                 steps=4, corpus=changed)), ("tokenizer",),
                 check_ok=lambda r: AutoTokenizer.from_pretrained(out / "attnres" / "final").get_vocab() == original)

    # R6 another --tokenizer on resume
    other = WORK / "other_tok"
    train_bpe_tokenizer(["quite different text"] * 30, 300).save_pretrained(other)
    out = WORK / "r6"
    ckpt = copy_ckpt(base, out, "attnres", 2)
    expect_error("resume", "--tokenizer with another vocabulary on resume",
                 lambda: train_clm.main(tiny_run(out, "--tokenizer", str(other), "--save_steps", "2",
                                                 "--resume_from_checkpoint", str(ckpt), steps=4)),
                 ("--tokenizer",), check_ok=lambda r: False)

    # R7-R13 damaged newest checkpoint with latest: resume from checkpoint-2 (the reference curve) or name it
    damages = {"optimizer.pt deleted": ("optimizer.pt", "delete"), "scheduler.pt deleted": ("scheduler.pt", "delete"),
               "trainer_state.json deleted": ("trainer_state.json", "delete"),
               "trainer_state.json truncated": ("trainer_state.json", "truncate"),
               "model.safetensors truncated": ("model.safetensors", "truncate"),
               "model.safetensors deleted": ("model.safetensors", "delete"),
               "optimizer.pt truncated": ("optimizer.pt", "truncate")}
    refusals = ("cannot resume", "No valid checkpoint", "valid checkpoint", "incomplete")
    for label, (file, how) in damages.items():
        out = WORK / f"r_damage_{file}_{how}"
        copy_ckpt(base, out, "attnres", 2)
        bad = copy_ckpt(base, out, "attnres", 4)
        state = bad / "trainer_state.json"  # tag what the checkpoint holds: a right resume recomputes steps 3-4
        logged = json.loads(state.read_text())
        for entry in logged["log_history"]:
            entry["from_checkpoint"] = True
        state.write_text(json.dumps(logged))
        if how == "delete":
            (bad / file).unlink()
        else:
            data = (bad / file).read_bytes()
            (bad / file).write_bytes(data[: len(data) // 2])

        def same_curve(result, out=out):
            steps = {h["step"]: h for h in result["runs"][0]["log_history"] if "loss" in h}
            recomputed = all(not steps[s].get("from_checkpoint") for s in (3, 4))
            return recomputed and abs(result["runs"][0]["eval_loss"] - ref_loss) <= 1e-5 * abs(ref_loss)
        expect_error("checkpoint", f"latest with checkpoint-4 {label}",
                     lambda out=out: train_clm.main(tiny_run(out, "--save_steps", "2", "--resume_from_checkpoint",
                                                             "latest", "--attnres_block_size", "2", steps=4)),
                     refusals, check_ok=same_curve)
    out = WORK / "r_explicit"
    bad = copy_ckpt(base, out, "attnres", 4)
    (bad / "trainer_state.json").write_text("{\"global_st")
    expect_error("checkpoint", "explicit checkpoint with a truncated trainer_state.json",
                 lambda: train_clm.main(tiny_run(out, "--attnres_block_size", "2", "--resume_from_checkpoint",
                                                 str(bad), steps=4)), ("cannot resume", "valid checkpoint"),
                 check_ok=lambda r: False)

    # R14 a full disk while checkpointing: torch.save says "unexpected pos", safetensors says nothing
    out = WORK / "r_full"
    real_save, real_usage = torch.save, shutil.disk_usage

    def full_save(obj, path, *a, **k):
        if str(path).endswith("optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, path, *a, **k)
    torch.save, shutil.disk_usage = full_save, lambda p: shutil._ntuple_diskusage(10**9, 10**9, 0)
    try:
        expect_error("checkpoint", "full disk while saving a checkpoint",
                     lambda: train_clm.main(tiny_run(out, "--attnres_block_size", "2", "--save_steps", "2", steps=2)),
                     ("full", "No space"), check_ok=lambda r: False)
    finally:
        torch.save, shutil.disk_usage = real_save, real_usage
    expect_error("checkpoint", "latest after the full disk (checkpoint without optimizer)",
                 lambda: train_clm.main(tiny_run(out, "--attnres_block_size", "2", "--save_steps", "2",
                                                 "--resume_from_checkpoint", "latest", steps=4)),
                 refusals, check_ok=lambda r: False)


# ---------------------------------------------------------------------------------------------------------------
# Upcycling
# ---------------------------------------------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def llama_folder(folder: Path, vocab: int, tokenizer: bool = True):
    tok = train_bpe_tokenizer(load_documents()[:40], vocab_size=vocab) if tokenizer else None
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id) \
        if tok else {}
    llama = transformers.LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=2, num_attention_heads=2,
                                                      num_key_value_heads=1, max_position_embeddings=64, **special))
    llama.generation_config = GenerationConfig(**special, repetition_penalty=1.3)
    llama.save_pretrained(folder)
    if tok is not None:
        tok.chat_template = TEMPLATE
        tok.save_pretrained(folder)
    return tok


def probe_upcycling() -> None:
    folder = WORK / "llama_tok"
    own = llama_folder(folder, 420)
    out = WORK / "u1"
    try:
        train_clm.main(tiny_run(out, "--init_from", str(folder), model="denseformer"))
        saved = AutoTokenizer.from_pretrained(out / "denseformer" / "final")
        record("upcycle", "--init_from uses the Llama's own tokenizer",
               "ok" if saved.get_vocab() == own.get_vocab() else "silent", f"{len(saved)} vs {len(own)} tokens")
        record("upcycle", "--init_from keeps the chat template", "ok" if saved.chat_template == TEMPLATE else "silent")
        generation = json.loads((out / "denseformer" / "final" / "generation_config.json").read_text())
        record("upcycle", "--init_from keeps the generation config",
               "ok" if generation.get("repetition_penalty") == 1.3 else "silent", str(generation)[:100])
    except Exception as error:  # noqa: BLE001
        for name in ("tokenizer", "chat template", "generation config"):
            record("upcycle", f"--init_from keeps the {name}", "traceback", f"{type(error).__name__}: {error}")
    other = WORK / "other420"
    train_bpe_tokenizer(load_documents()[50:90], vocab_size=420).save_pretrained(other)
    expect_error("upcycle", "--init_from with a --tokenizer of another vocabulary",
                 lambda: train_clm.main(tiny_run(WORK / "u2", "--init_from", str(folder), "--tokenizer", str(other),
                                                 model="denseformer")), ("--tokenizer",), check_ok=lambda r: False)
    bare = WORK / "llama_bare"
    llama_folder(bare, 300, tokenizer=False)
    expect_error("upcycle", "--init_from a Llama folder without a tokenizer",
                 lambda: train_clm.main(tiny_run(WORK / "u3", "--init_from", str(bare), model="denseformer")),
                 ("--tokenizer",), check_ok=lambda r: False)
    expect_error("upcycle", "--init_from with a tokenizer larger than the Llama's vocabulary",
                 lambda: train_clm.main(tiny_run(WORK / "u4", "--init_from", str(bare), "--tokenizer", str(other),
                                                 model="denseformer")), ("vocab_size", "--tokenizer"),
                 check_ok=lambda r: False)


# ---------------------------------------------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------------------------------------------

def probe_conversions() -> None:
    from depthfusion_hf.export import save_remote_code_folder

    tok = train_bpe_tokenizer(load_documents()[:5], vocab_size=400)
    tok.chat_template = TEMPLATE
    vocab = len(tok)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, vocab - 1], pad_token_id=tok.pad_token_id)
    llama = transformers.LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, **ids)).to(torch.bfloat16)
    llama.generation_config = GenerationConfig(**ids, repetition_penalty=1.3)
    folder = WORK / "llama_conv"
    llama.save_pretrained(folder)
    tok.save_pretrained(folder)
    for converter in (convert.llama_to_denseformer, convert.llama_to_moda, convert.llama_to_attnres):
        name = converter.__name__
        try:
            model = converter(folder)
        except Exception as error:  # noqa: BLE001
            for what in ("eos list", "repetition penalty", "parameter dtype", "config dtype", "special ids",
                         "chat template"):
                record("convert", f"{name}: {what}", "traceback", f"{type(error).__name__}: {error}")
            continue
        record("convert", f"{name}: generation eos_token_id list",
               "ok" if model.generation_config.eos_token_id == ids["eos_token_id"] else "silent",
               str(model.generation_config.eos_token_id))
        record("convert", f"{name}: generation repetition_penalty",
               "ok" if model.generation_config.repetition_penalty == 1.3 else "silent",
               str(model.generation_config.repetition_penalty))
        record("convert", f"{name}: parameter dtype",
               "ok" if {p.dtype for p in model.parameters()} == {torch.bfloat16} else "silent")
        record("convert", f"{name}: config dtype", "ok" if model.config.dtype == torch.bfloat16 else "silent",
               str(model.config.dtype))
        record("convert", f"{name}: special token ids",
               "ok" if all(getattr(model.config, k) == v for k, v in ids.items()) else "silent")
        out = WORK / f"conv_{name}"
        try:
            save_remote_code_folder(model, out, tokenizer=AutoTokenizer.from_pretrained(folder))
            saved = AutoTokenizer.from_pretrained(out)
            generation = json.loads((out / "generation_config.json").read_text())
            good = saved.chat_template == TEMPLATE and generation.get("eos_token_id") == ids["eos_token_id"]
            record("convert", f"{name}: saved with the Llama's tokenizer (chat template, generation config)",
                   "ok" if good else "silent", str(generation.get("eos_token_id")))
        except Exception as error:  # noqa: BLE001
            record("convert", f"{name}: saved with the Llama's tokenizer", "traceback",
                   f"{type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------------------------------
# Records and cards; the user's own files in the output folder
# ---------------------------------------------------------------------------------------------------------------

def probe_records() -> None:
    out = WORK / "rec"
    val = WORK / "val.txt"
    val.write_text("\n\n".join(load_documents()[100:104]), encoding="utf-8")
    args = tiny_run(out, "--validation_files", str(val), model="denseformer")
    args.remove("--validation_fraction"), args.remove("0.1")
    results = train_clm.main(args)
    stored = json.loads((out / "results.json").read_text())
    text = json.dumps(stored.get("data", {}))
    record("records", "results.json names the training file", "ok" if CORPUS.name in text and "sha256" in text
           else "silent", text[:120] or f"args.dataset={stored['args'].get('dataset')}")
    record("records", "results.json names the validation file", "ok" if val.name in text else "silent")
    model = AutoModelForCausalLM.from_pretrained(out / "denseformer" / "final")
    entries = clm_results(stored, "denseformer")
    meta, body = split_front_matter(build_model_card(model, "me/x", results=entries))
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    record("records", "card model-index names the local file", "ok" if CORPUS.name in dataset["name"] else "silent",
           str(dataset))
    record("records", "card claims no King James data for a local-files run",
           "silent" if "King James" in json.dumps(meta) + body or "kjv" in json.dumps(meta.get("datasets")) else "ok",
           str(meta.get("datasets")))
    hub = {"args": {"dataset": "wikitext", "dataset_config": "wikitext-2-raw-v1"}, "settings": {"max_steps": 1},
           "runs": results["runs"],
           "data": {"source": "hub", "name": "wikitext", "config": "wikitext-2-raw-v1", "files": []}}
    meta, _ = split_front_matter(build_model_card(model, "me/x", results=clm_results(hub, "denseformer")))
    dataset = meta["model-index"][0]["results"][0]["dataset"]
    record("records", "card model-index names a Hub dataset's configuration",
           "ok" if dataset.get("config") == "wikitext-2-raw-v1" else "silent", str(dataset))
    old = {"args": {"dataset": "kjv", "train_files": ["my.txt"]}, "settings": {"max_steps": 1}, "runs": results["runs"]}
    try:
        entry = clm_results(old, "denseformer")[0]
        record("records", "a results.json without a data record is refused (never called KJV)", "silent",
               entry["dataset_name"])
    except ValueError as error:
        record("records", "a results.json without a data record is refused (never called KJV)",
               "ok" if "'data' record" in str(error) else "misleading", str(error)[:120])


def probe_user_files() -> None:
    for name, text in (("results.md", "# my own notes\n"), ("results.json", '{"my": "numbers"}')):
        out = WORK / f"user_{name}"
        out.mkdir()
        (out / name).write_text(text)
        try:
            train_clm.main(tiny_run(out, model="denseformer"))
        except Exception as error:  # noqa: BLE001
            kept = (out / name).read_text() == text
            record("dataloss", f"a user's {name} in the output folder",
                   "ok" if kept and name in str(error) else "traceback", f"{type(error).__name__}: {error}")
            continue
        record("dataloss", f"a user's {name} in the output folder",
               "ok" if (out / name).read_text() == text else "loss")


def main() -> None:
    CORPUS.write_text("\n\n".join(load_documents()[:30]), encoding="utf-8")
    ARCH.write_text(json.dumps({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
                                "tie_word_embeddings": True}))
    groups = (probe_configs, probe_config_json, probe_config_files, probe_upcycling, probe_cli, probe_conversions,
              probe_records, probe_user_files, probe_resume)
    if len(sys.argv) > 3:  # a subset: comma-separated group names
        groups = [g for g in groups if g.__name__ in sys.argv[3].split(",")]
    for group in groups:
        try:
            group()
        except Exception:  # noqa: BLE001 - a probe group that breaks is reported, the others still run
            record(group.__name__, "probe group crashed", "probe-error", traceback.format_exc()[-300:])
    counts: dict[str, int] = {}
    for result in RESULTS:
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    Path(sys.argv[2]).write_text(json.dumps({"root": str(ROOT), "counts": counts, "cases": RESULTS}, indent=1))
    print(json.dumps(counts))
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
