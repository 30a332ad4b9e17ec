"""What the recording endpoint costs: requests/s and tokens/s through `skillswarm endpoint serve` (a
separate process, HTTP, the official `openai` client, recording every call) against calling the same
engine directly with the same prompts in batches of the same size, measured in the same run.

C client threads each send R chat requests (a short prompt, max_tokens T, temperature 1) at once, so the
endpoint can batch up to C of them; the direct baseline runs the same C*R prompts through
`engine.generate` in batches of C. `ratio` is endpoint tokens/s over direct tokens/s (goal >= 0.8);
`requests_ratio` the same for requests/s. Both sides use one torch thread (the nano model's setting).

The nano model generates a reply in about 2 ms of a batch, less than the official client alone spends on a
request, so on it the ratio measures per-request cost; `--wide` measures a randomly initialised 134M-parameter
Llama on the nano tokenizer instead (built in a temporary directory), where generation dominates as it does
for real models.

    .venv/bin/python bench/endpoint.py [--model DIR | --wide] [--clients 16] [--requests 8] [--max-tokens 48] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"{(i * 37) % 90 + 10}+{(i * 53) % 90 + 10}"}] for i in range(n)]


def _direct(model: Path, prompts: list[list[dict[str, str]]], batch: int, max_tokens: int) -> tuple[float, int]:
    import torch

    from skillswarm.node.rl.engines.hf import HFEngine
    from skillswarm.skills.chat import encode, render
    from skillswarm.skills.episode import Message

    torch.set_num_threads(1)
    engine = HFEngine.load(model, device="cpu")
    ids = [encode(engine.tokenizer, render(engine.tokenizer, [Message(**m) for m in p], add_generation_prompt=True))
           for p in prompts]
    engine.generate(ids[:batch], max_tokens, 1.0)  # warm-up
    t0 = time.perf_counter()
    tokens = 0
    for at in range(0, len(ids), batch):
        tokens += sum(len(g.token_ids) for g in engine.generate(ids[at:at + batch], max_tokens, 1.0))
    return time.perf_counter() - t0, tokens


def _through_endpoint(model: Path, prompts: list[list[dict[str, str]]], clients: int, max_tokens: int) -> tuple[float, int, dict]:
    from openai import OpenAI

    skillswarm = Path(sys.executable).with_name("skillswarm")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([str(skillswarm), "endpoint", "serve", "--model", str(model), "--store", tmp, "--port", "0",
                                 "--threads", "1", "--max-batch", str(clients)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "COLUMNS": "400"})
        try:
            url = None
            deadline = time.monotonic() + 120
            while url is None and time.monotonic() < deadline:
                line = proc.stdout.readline()  # type: ignore[union-attr]
                if not line:
                    raise SystemExit(f"the endpoint exited ({proc.wait()})")
                found = re.search(r"(http://\S+/v1)", line)
                url = found.group(1) if found else None
            client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

            def call(messages: list[dict[str, str]]) -> int:
                r = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=1.0)  # type: ignore[arg-type]
                return r.usage.completion_tokens if r.usage else 0

            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(call, prompts[:clients]))  # warm-up
                t0 = time.perf_counter()
                tokens = sum(pool.map(call, prompts))
                seconds = time.perf_counter() - t0
            stats = client.get("/stats", cast_to=object)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return seconds, tokens, stats  # type: ignore[return-value]


def _wide_model(directory: Path) -> Path:
    """A randomly initialised 134M-parameter Llama with the nano tokenizer (generation cost of a real small model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from skillswarm.skills.nano.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=16, intermediate_size=4096, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the nano base, built if needed)")
    parser.add_argument("--wide", action="store_true", help="a random 134M-parameter model instead of the nano base")
    parser.add_argument("--clients", type=int, default=16, help="concurrent client threads (and the direct batch size)")
    parser.add_argument("--requests", type=int, default=8, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every request")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        parser.error("--clients, --requests and --max-tokens must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        if args.wide:
            args.model = _wide_model(Path(tmp) / "wide")
        elif args.model is None:
            from skillswarm.skills.nano.build import build_base

            args.model = build_base()
        prompts = _prompts(args.clients * args.requests)
        direct_s, direct_tokens = _direct(args.model, prompts, args.clients, args.max_tokens)
        served_s, served_tokens, stats = _through_endpoint(args.model, prompts, args.clients, args.max_tokens)
    n = len(prompts)
    out = {
        "model": "wide-134M (random)" if args.wide else str(args.model), "clients": args.clients, "requests": n, "max_tokens": args.max_tokens,
        "direct_requests_per_s": round(n / direct_s, 2), "direct_tokens_per_s": round(direct_tokens / direct_s, 1),
        "endpoint_requests_per_s": round(n / served_s, 2), "endpoint_tokens_per_s": round(served_tokens / served_s, 1),
        "requests_ratio": round((n / served_s) / (n / direct_s), 3),
        "ratio": round((served_tokens / served_s) / (direct_tokens / direct_s), 3),
        "endpoint_engine_batches": stats.get("engine_batches"), "endpoint_rows_per_batch": round(
            stats.get("engine_rows", 0) / max(1, stats.get("engine_batches", 1)), 2),
        "recorded_trajectories": stats["store"].get("trajectories"),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for k, v in out.items():
        print(f"{k:>26}: {v}")


if __name__ == "__main__":
    main()
