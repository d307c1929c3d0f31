"""Naive vs stitched time-to-first-token on one GPU, in one process, on the same ids.

    python -m loadtest.bench_prefill --contexts 4096 8192 16384 --runs 7 --json out.json

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights directly on the GPU (no weights can
be downloaded; random weights of the real shape give honest timings). TTFT is wall-clock from "ids ready" to
"first token id on the host", synchronised, median of --runs after --warmup runs.

Tiers measured here (the KV-cache issue adds the disk tier and overlapped copies):
- naive: one causal prefill over prefix + chunks + question.
- stitched/gpu: chunk KV already on the GPU; rotate + place, then prefill only the question.
- stitched/host: chunk KV in pinned host memory; a plain non-overlapped copy, then as above.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtest.qwen_vocab import qwen_tokenizer
from service.devtools.tiny_model import CHATML_TEMPLATE, build_tokenizer
from service.engine.engine import StitchEngine
from service.engine.gate import run_gate, synthetic_ids
from service.engine.kv_layout import KVBlock
from service.engine.model import WEIGHTLESS, LoadedModel, load_model, shell_from_config, spec_from_config
from service.kvcache import device
from service.kvcache.keys import canonical_config

log = logging.getLogger("bench_prefill")
QWEN2_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
}


RANDOM_SEED = 0


def random_qwen2_7b(device: torch.device, vocabulary: str = "stand-in") -> LoadedModel:
    """Qwen2-7B shape, random bf16 weights, built on the device; the tokenizer is the tiny stand-in BPE, or with
    `vocabulary="qwen"` Qwen's own (`loadtest.qwen_vocab`), for benchmarks whose prompts are text. The model names
    its own fingerprint (`random_fingerprint`): a shell of it (`random_qwen2_7b_shell`) keys chunks alike."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**QWEN2_7B)
    torch.manual_seed(RANDOM_SEED)
    with device:
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.eval().requires_grad_(False)
    spec = spec_from_config(config, torch.bfloat16, device)
    fingerprint = random_fingerprint(vocabulary, device.type)
    return LoadedModel(hf, random_tokenizer(vocabulary), spec, random_source(vocabulary), fingerprint)


def random_qwen2_7b_shell(vocabulary: str, engine_device: str) -> LoadedModel:
    """`random_qwen2_7b` without weights (a gateway's copy: it tokenizes and keys chunks), with the fingerprint
    the engines' models built on `engine_device` name."""
    from transformers import Qwen2Config

    config = Qwen2Config(**QWEN2_7B)
    hf = shell_from_config(config, torch.bfloat16)
    spec = spec_from_config(config, torch.bfloat16, WEIGHTLESS)
    fingerprint = random_fingerprint(vocabulary, engine_device)
    return LoadedModel(hf, random_tokenizer(vocabulary), spec, random_source(vocabulary), fingerprint)


def random_fingerprint(vocabulary: str, device_type: str) -> str:
    """The random model's identity: its shape, vocabulary, seed and the kind of device that drew its weights (one
    seed draws the same weights on the same kind of device, so every engine built so computes the same KV). The
    config is a fresh one: building a model writes fields into the config it is given."""
    from transformers import Qwen2Config

    config = canonical_config(Qwen2Config(**QWEN2_7B).to_dict())
    name = f"{random_source(vocabulary)}/seed-{RANDOM_SEED}/{device_type}/bfloat16/{config}"
    return hashlib.sha256(name.encode()).hexdigest()


def random_source(vocabulary: str) -> str:
    return "random:qwen2-7b" if vocabulary == "stand-in" else f"random:qwen2-7b+{vocabulary}-vocab"


def random_tokenizer(vocabulary: str) -> Any:
    if vocabulary == "qwen":
        return qwen_tokenizer()
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def timed(
    fn: Callable[[], Any], runs: int, warmup: int, target: torch.device, prepare: Callable[[], None] | None = None
) -> list[float]:
    """Milliseconds of each run of `fn`, synchronised before and after; `prepare` runs untimed before each."""
    for _ in range(warmup):
        if prepare:
            prepare()
        fn()
    times = []
    for _ in range(runs):
        if prepare:
            prepare()
        device.synchronize(target)
        start = time.perf_counter()
        fn()
        device.synchronize(target)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def build_engine(model_dir: str | None, target: torch.device, vocabulary: str = "stand-in") -> StitchEngine:
    """The engine over a model folder, or over a random Qwen2-7B-shaped model (and `vocabulary`) when none is
    given."""
    model = load_model(model_dir, device=target) if model_dir else random_qwen2_7b(target, vocabulary)
    return StitchEngine(model)


def open_benchmark_engine(model_dir: str | None, device_name: str) -> tuple[StitchEngine, dict[str, Any]] | None:
    """The engine to time and the report's machine fields; None (logged) when CUDA is asked for but absent."""
    target = torch.device(device_name)
    if target.type == "cuda" and not torch.cuda.is_available():
        log.error("no CUDA device: pass --device cpu --model DIR for a smoke run")
        return None
    name = torch.cuda.get_device_name() if target.type == "cuda" else "cpu"
    return build_engine(model_dir, target), {"device": name, "torch": torch.__version__}


def question_ids(engine: StitchEngine, suffix_tokens: int) -> list[int]:
    """Question ids sized so the prefilled suffix (instruction tail + question + header) is `suffix_tokens` long."""
    fixed = len(engine.template.question_head) + len(engine.template.question_tail)
    return synthetic_ids(engine, [max(1, suffix_tokens - fixed)], seed=1)[0]


def context_chunks(engine: StitchEngine, context: int, chunk_tokens: int, seed: int) -> list[list[int]]:
    """Chunk ids whose wrapped blocks, with the prefix, fill about `context` tokens."""
    wrap = len(engine.template.doc_open) + len(engine.template.doc_close)
    count = max(1, round((context - len(engine.template.prefix)) / (chunk_tokens + wrap)))
    return synthetic_ids(engine, [chunk_tokens] * count, seed)


def precompute_all(engine: StitchEngine, blocks: list[tuple[int, ...]], batch: int) -> tuple[list[KVBlock], float]:
    device.synchronize(engine.spec.device)
    start = time.perf_counter()
    out: list[KVBlock] = []
    for i in range(0, len(blocks), batch):
        out += engine.precompute(blocks[i : i + batch])
    device.synchronize(engine.spec.device)
    return out, time.perf_counter() - start


def bench_context(engine: StitchEngine, context: int, args: argparse.Namespace) -> dict[str, Any]:
    chunks = context_chunks(engine, context, args.chunk_tokens, seed=context)
    question = question_ids(engine, args.question_tokens)
    prompt = engine.template.prompt(chunks, question)
    gpu_kv, seconds = precompute_all(engine, list(prompt.blocks), args.precompute_batch)
    pin = engine.spec.device.type == "cuda"
    host_kv = [KVBlock(b.token_ids, b.kv.cpu().pin_memory() if pin else b.kv.clone()) for b in gpu_kv]

    def first_token(logits: torch.Tensor) -> int:
        return int(torch.argmax(logits))

    def naive() -> int:
        return first_token(engine.prefill_naive(prompt)[1])

    def stitched(kv: list[KVBlock]) -> Callable[[], int]:
        return lambda: first_token(engine.prefill_stitched(kv, prompt.question)[1])

    def stitch_only() -> None:
        engine.stitch(gpu_kv, "reordered", len(prompt.question))

    buffer, plan = engine.stitch(gpu_kv, "reordered", len(prompt.question))

    def question_only() -> int:
        buffer.truncate(plan.context_tokens, plan.question_start)
        return first_token(engine.prefill_question(buffer, prompt.question))

    row: dict[str, Any] = {
        "context_tokens": prompt.context_tokens,
        "chunks": len(chunks),
        "question_tokens": len(prompt.question),
        "kv_bytes": sum(b.nbytes() for b in gpu_kv) + engine.prefix_block.nbytes(),
        "precompute_tokens_per_s": sum(len(b) for b in prompt.blocks) / seconds,
        "naive_ms": timed(naive, args.runs, args.warmup, engine.spec.device),
        "stitched_gpu_ms": timed(stitched(gpu_kv), args.runs, args.warmup, engine.spec.device),
        "stitched_host_ms": timed(stitched(host_kv), args.runs, args.warmup, engine.spec.device),
        "stitch_gpu_only_ms": timed(stitch_only, args.runs, args.warmup, engine.spec.device),
        "question_prefill_only_ms": timed(question_only, args.runs, args.warmup, engine.spec.device),
    }
    if args.decode_tokens:
        row["decode_step_ms"] = decode_steps(engine, gpu_kv, prompt.question, args.decode_tokens)
    return row


def decode_steps(engine: StitchEngine, kv: list[KVBlock], question: tuple[int, ...], steps: int) -> list[float]:
    """Milliseconds of each greedy decode step (forward + argmax to the host) after a stitched prefill."""
    buffer, _, _ = engine.prefill_stitched(kv, question, extra_tokens=steps)
    token, times = 0, []
    for _ in range(steps):
        device.synchronize(engine.spec.device)
        start = time.perf_counter()
        logits = engine.forward.extend(buffer, [token], torch.tensor([buffer.next_position]))
        token = int(torch.argmax(logits))
        times.append((time.perf_counter() - start) * 1e3)
    return times[2:]  # the first steps warm the decode shapes up


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    """Add the median of every list of run times; the runs themselves stay in the row."""
    medians = {f"median_{k}": statistics.median(v) for k, v in row.items() if isinstance(v, list)}
    return {**row, **medians}


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| context | chunks | KV MB | naive ms | stitched, GPU tier ms | speedup | stitched, pinned host (plain copy)"
        " ms | stitch only ms | question prefill only ms | decode ms/token | precompute tok/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['context_tokens']} | {r['chunks']} | {r['kv_bytes'] / 1e6:.0f} | {r['median_naive_ms']:.1f} "
            f"| {r['median_stitched_gpu_ms']:.1f} | {r['median_naive_ms'] / r['median_stitched_gpu_ms']:.1f}x "
            f"| {r['median_stitched_host_ms']:.1f} | {r['median_stitch_gpu_only_ms']:.2f} "
            f"| {r['median_question_prefill_only_ms']:.1f} "
            f"| {r.get('median_decode_step_ms', float('nan')):.1f} | {r['precompute_tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload options every GPU benchmark shares: model, context lengths, chunk and question sizes."""
    parser.add_argument("--model", default=None, help="HF folder; default: random Qwen2-7B shape")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--precompute-batch", type=int, default=16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--gate", action="store_true", help="also run the correctness gate and report its diff")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run with --model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    opened = open_benchmark_engine(args.model, args.device)
    if opened is None:
        return 2
    engine, machine = opened
    report: dict[str, Any] = {**machine, "rows": []}
    if args.gate:
        gate = run_gate(engine)
        report["gate_max_abs_logit_diff"] = gate.max_abs_logit_diff
        log.info("gate: max_abs_logit_diff=%.4f tolerance=%.3f", gate.max_abs_logit_diff, gate.tolerance)
    for context in args.contexts:
        row = summarise(bench_context(engine, context, args))
        report["rows"].append(row)
        log.info("%s", json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}))
    sys.stdout.write(table(report["rows"]) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
