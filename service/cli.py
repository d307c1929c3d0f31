"""The `kvstitch` command line: serve | engine | worker | ingest | ask | documents | verify | tiny-model | import-gguf |
eval | finetune | make-qa."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from service.quality.measured import DEFAULT_KEEP
from service.serving.data_dir_lock import DataDirInUseError

if TYPE_CHECKING:
    import torch

# This module imports no torch, so the client commands (ask, documents, ingest, cancel) start without it: dtypes are
# named here and resolved by the commands that load a model (`_dtype`), the default device likewise (`_on_device`).
# verify, eval and finetune check, measure and train what the service serves by default (KVSTITCH_CHUNK_CONTEXT):
# `service.engine.kv_layout.SERVED_CHUNK_CONTEXT`, by value (tests/test_engine_chunk_context.py keeps them equal).
DEFAULT_CHUNK_CONTEXT = "prefix"
DTYPES = ("bfloat16", "float16", "float32")
DEVICE_HELP = "torch device (default: cuda when available, else cpu)"
# Commands that print what a server says, often into `| head` or `| less`: a reader gone is a normal end for them.
CLIENT_COMMANDS = ("ask", "documents", "ingest", "cancel")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; every argument carries help text (tests/test_cli_help.py checks it)."""
    parser = argparse.ArgumentParser(prog="kvstitch", description="RAG serving with stitched chunk KV caches")
    commands = parser.add_subparsers(dest="command", required=True)

    verify = commands.add_parser("verify", help="run the correctness gate on a model and print the largest diff")
    verify.add_argument("--model", required=True, help="HF model folder or hub id")
    verify.add_argument("--device", default=None, help=DEVICE_HELP)
    verify.add_argument("--dtype", choices=DTYPES, default=None, help="default: fp32 on CPU, bf16 on CUDA")
    verify.add_argument(
        "--tolerance", type=float, default=None, help="default: 1e-4 in fp32; in bf16 10%% of the largest logit"
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the synthetic chunks and question (default 0)")
    verify.add_argument(
        "--chunk-context",
        choices=("alone", "prefix"),
        default=DEFAULT_CHUNK_CONTEXT,
        help=f"what chunks are precomputed after, as KVSTITCH_CHUNK_CONTEXT (default {DEFAULT_CHUNK_CONTEXT})",
    )
    verify.add_argument(
        "--kv-path",
        choices=("copy", "shared"),
        default="copy",
        help="shared: also check the zero-copy path (shared chunk arena, as KVSTITCH_SHARED_CHUNKS=on) against the "
        "reference, to the same tolerance (default copy)",
    )

    tiny = commands.add_parser("tiny-model", help="write a tiny random-weight model folder (tests, offline demo)")
    tiny.add_argument("out_dir", help="folder to write the model and tokenizer to (created)")
    tiny.add_argument(
        "--arch", choices=("llama", "qwen2", "mistral"), default="qwen2", help="architecture (default qwen2)"
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    _add_import_gguf(commands)

    serve = commands.add_parser("serve", help="run the gateway (embedded Qdrant, index and worker by default)")
    _add_runtime_options(serve)
    serve.add_argument("--host", default=None, help="KVSTITCH_HOST (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="KVSTITCH_PORT (default 8000)")
    serve.add_argument("--no-gate", action="store_true", help="skip the start-up correctness gate")
    serve.add_argument(
        "--engines",
        default=None,
        metavar="URL,...",
        help="gateway mode: send questions to these `kvstitch engine` URLs, or `redis` for the engines announced "
        "there (KVSTITCH_ENGINES; default: answer in this process)",
    )
    serve.add_argument(
        "--gpus",
        default=None,
        metavar="N,...",
        help="start one `kvstitch engine` per GPU (CUDA_VISIBLE_DEVICES=N, port ENGINE_PORT+N) and route to them",
    )
    serve.add_argument(
        "--engine-port", type=int, default=None, help="with --gpus: the first engine's port base (default 8100)"
    )

    engine = commands.add_parser(
        "engine", help="serve one engine (scheduler, KV tiers) to gateways over an internal HTTP API"
    )
    _add_runtime_options(engine)
    engine.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    engine.add_argument("--port", type=int, default=None, help="port to listen on (default 8100)")
    engine.add_argument("--no-gate", action="store_true", help="skip the start-up correctness gate")

    ask = commands.add_parser("ask", help="stream an answer from a running server, then TTFT and tier hits")
    ask.add_argument("question", help="the question, in quotes")
    ask.add_argument("--url", default=None, help="server (default: KVSTITCH_URL or http://127.0.0.1:8000)")
    ask.add_argument("--api-key", default=None, help="bearer token (default: KVSTITCH_API_KEY)")
    ask.add_argument(
        "--mode", choices=("turbo", "naive"), default="turbo", help="turbo: stitched chunk KV; naive: full prefill"
    )
    ask.add_argument(
        "--positions", choices=("reordered", "composite"), default="reordered", help="positions of the stitched chunks"
    )
    ask.add_argument("--top-k", type=int, default=5, help="chunks to retrieve (default 5)")
    ask.add_argument("--max-new-tokens", type=int, default=None, help="answer length limit (default: the server's)")
    ask.add_argument(
        "--recompute",
        default=None,
        metavar="SPEC",
        help="none | prefix:N | selective:R[:F] | query:R[:F] | auto (server default)",
    )
    ask.add_argument(
        "--filter",
        default=None,
        metavar="JSON",
        help='metadata filter, e.g. \'{"must": [{"key": "lang", "match": "en"}]}\' (docs/api.md)',
    )

    worker = commands.add_parser("worker", help="consume ingest jobs from Redis (KVSTITCH_REDIS_URL)")
    _add_runtime_options(worker)
    worker.add_argument("--name", default=None, help="consumer name (default: host-pid)")

    ingest = commands.add_parser(
        "ingest", help="ingest text, Markdown, HTML and PDF files and folders, via a server or embedded"
    )
    ingest.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        # service.formats.EXTENSIONS, spelled out so `--help` imports no extractor (a test keeps the two equal)
        help="files (any name: told by their content) and folders, walked recursively for .txt, .text, .md, "
        ".markdown, .html, .htm, .xhtml and .pdf files; each file a walk skips is listed with its reason",
    )
    ingest.add_argument(
        "--url", default=None, help="server to send to (default: KVSTITCH_URL or http://127.0.0.1:8000)"
    )
    ingest.add_argument("--api-key", default=None, help="bearer token (default: KVSTITCH_API_KEY)")
    ingest.add_argument("--embedded", action="store_true", help="ingest in this process, no server (needs --model)")
    ingest.add_argument("--batch", type=int, default=100, help="documents per job (default 100)")
    _add_runtime_options(ingest)
    _add_documents(commands)

    cancel = commands.add_parser("cancel", help="cancel a queued or running ingest job on a server")
    cancel.add_argument("job_id", metavar="JOB_ID", help="the id `kvstitch ingest` or POST /ingest gave")
    cancel.add_argument("--url", default=None, help="server (default: KVSTITCH_URL or http://127.0.0.1:8000)")
    cancel.add_argument("--api-key", default=None, help="bearer token (default: KVSTITCH_API_KEY)")
    _add_quality_commands(commands)
    return parser


def _add_import_gguf(commands: Any) -> None:
    gguf = commands.add_parser(
        "import-gguf", help="convert a GGUF checkpoint into an HF folder kvstitch serves (needs kvstitch[gguf])"
    )
    gguf.add_argument("file", help="the .gguf file (llama.cpp's format; llama, qwen2 or mistral)")
    gguf.add_argument("--out", required=True, help="new folder for the safetensors weights, config and tokenizer")
    gguf.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16", "float32", "bfloat16", "float16"),
        default=None,
        help="dtype of the saved weights (default fp32: the GGUF's tensors dequantised)",
    )


def _add_documents(commands: Any) -> None:
    """`documents` lists a page; `documents show ID` and `documents delete ID` act on one document."""
    from service.commands.documents import MAX_LIMIT

    documents = commands.add_parser("documents", help="list, show or delete the documents a running server stores")
    _add_client_options(documents, argparse.SUPPRESS)  # the subcommands' own copies win when given
    documents.add_argument("--offset", type=int, default=0, help="documents to skip, sorted by id (default 0)")
    documents.add_argument("--limit", type=int, default=20, help=f"documents per page, 1-{MAX_LIMIT} (default 20)")
    actions = documents.add_subparsers(dest="action", metavar="{show,delete}", title="actions (default: list)")
    show = actions.add_parser("show", help="one document: version, chunks, tokens, ingested time, metadata")
    show.add_argument("doc_id", metavar="ID", help="the document's id")
    _add_client_options(show, argparse.SUPPRESS)
    delete = actions.add_parser("delete", help="remove a document and the KV blocks no other document uses")
    delete.add_argument("doc_id", metavar="ID", help="the document's id")
    delete.add_argument("--wait", action="store_true", help="follow the delete job until it is done")
    _add_client_options(delete, argparse.SUPPRESS, json=False)


def _add_client_options(parser: argparse.ArgumentParser, default: Any, json: bool = True) -> None:
    """--url, --api-key (and --json) for a command that talks to a running server."""
    parser.add_argument("--url", default=default, help="server (default: KVSTITCH_URL or http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=default, help="bearer token (default: KVSTITCH_API_KEY)")
    if json:
        parser.add_argument("--json", action="store_true", default=default, help="print the server's JSON as it is")


def _add_quality_commands(commands: Any) -> None:
    """eval, finetune and make-qa (service/quality): answer quality of stitched KV and block fine-tuning."""
    _add_eval(commands)
    _add_finetune(commands)
    _add_make_qa(commands)


def _add_eval(commands: Any) -> None:
    evaluate = commands.add_parser(
        "eval", help="answer a QA JSONL file (or questions over an ingested corpus) naive and turbo; compare"
    )
    evaluate.add_argument("--model", required=True, help="HF model folder or hub id")
    evaluate.add_argument("--data", default=None, help='JSONL: {"question", "chunks": [...], "answers": [...]}')
    evaluate.add_argument(
        "--data-dir", default=None, help="instead of --data: the data folder of an ingested corpus (with --questions)"
    )
    evaluate.add_argument(
        "--questions", default=None, metavar="FILE", help="with --data-dir: a UTF-8 text file, one question per line"
    )
    evaluate.add_argument(
        "--top-k", type=int, default=5, help="with --data-dir: chunks retrieved per question, as /ask (default 5)"
    )
    evaluate.add_argument(
        "--recompute",
        action="append",
        metavar="SPEC",
        help="none | prefix:N | selective:R[:F] | query:R[:F] | auto[:T], repeatable (default none)",
    )
    evaluate.add_argument(
        "--chunk-context",
        action="append",
        choices=("alone", "prefix"),
        help=f"what turbo's chunks are precomputed after, repeatable: rows for each (default {DEFAULT_CHUNK_CONTEXT})",
    )
    evaluate.add_argument(
        "--context-temperature",
        action="append",
        type=float,
        metavar="T",
        help="APE attention temperature on chunk keys, repeatable: turbo rows for each (default 1 = off)",
    )
    evaluate.add_argument(
        "--context-scale",
        action="append",
        type=float,
        metavar="S",
        help="APE scale on the context's log-sum-exp, repeatable: turbo rows for each (default 1 = off; needs "
        "--kv-path shared)",
    )
    evaluate.add_argument("--json", default=None, metavar="OUT", help="also write the rows as JSON to OUT")
    evaluate.add_argument(
        "--recommend",
        nargs="?",
        type=float,
        const=DEFAULT_KEEP,
        default=None,
        metavar="KEEP",
        help="with --data: write kvstitch-measured.json into the model folder, the recompute a server with "
        "KVSTITCH_RECOMPUTE=measured (the default) serves: the first --recompute, in the order given (cheapest "
        f"first), whose turbo reordered row keeps KEEP of naive's accuracy (default {DEFAULT_KEEP:g})",
    )
    evaluate.add_argument("--limit", type=int, default=None, help="use only N samples (after --offset)")
    evaluate.add_argument(
        "--offset", type=int, default=0, help="skip the first N samples (with --limit: one shard of a file)"
    )
    evaluate.add_argument(
        "--answers",
        default=None,
        metavar="OUT",
        help="write every answer as JSONL to OUT: one line per sample per row (answer, correct, f1, agreement)",
    )
    evaluate.add_argument(
        "--resume",
        action="store_true",
        help="with --data and --answers: keep the samples of this range that OUT holds for every row, answer only "
        "the rest (appended; a partly answered sample is answered again) and table them all; without it OUT is "
        "overwritten",
    )
    evaluate.add_argument(
        "--instruction",
        default=None,
        metavar="TEXT",
        help="added to the system message; default for --data: a short-answer instruction, for --data-dir: none "
        "(as /ask); '' for none",
    )
    evaluate.add_argument("--device", default=None, help=DEVICE_HELP)
    evaluate.add_argument("--dtype", choices=DTYPES, default=None, help="default: fp32 on CPU, bf16 on CUDA")
    evaluate.add_argument("--max-new-tokens", type=int, default=32, help="greedy answer length limit (default 32)")
    evaluate.add_argument(
        "--kv-path",
        choices=("copy", "shared"),
        default="copy",
        help="shared: turbo rows read their chunks from a shared chunk arena, as KVSTITCH_SHARED_CHUNKS=on serves "
        "them (default copy: each answer stitches its own context)",
    )
    evaluate.add_argument(
        "--batch",
        type=int,
        default=1,
        metavar="N",
        help="answer N samples at a time, each row's N answers in one scheduler run (1..256; default 1: one at a "
        "time). The answers are the same; with N > 1 the ttft_ms column is not measured (shown '-', null in JSON) "
        "and the KL column reads each answer's own first-token logits rather than a separate prefill",
    )


def _add_finetune(commands: Any) -> None:
    tune = commands.add_parser(
        "finetune", help="block fine-tune a model: self-distillation over an ingested corpus and/or labelled QA"
    )
    tune.add_argument("--model", required=True, help="HF model folder or hub id to start from")
    tune.add_argument(
        "--data", default=None, help="labelled QA JSONL file (the eval's format); the first answer is learnt"
    )
    tune.add_argument(
        "--data-dir",
        default=None,
        help="an ingested corpus's data folder: self-distillation on questions made from its chunks (stop its server)",
    )
    tune.add_argument(
        "--distill-data",
        default=None,
        help="a QA JSONL whose questions over its chunks are self-distillation prompts (its answers are not read)",
    )
    tune.add_argument("--out", required=True, help="folder for the fine-tuned HF model and tokenizer")
    tune.add_argument(
        "--prompts", type=int, default=512, help="with --data-dir: training prompts made from the corpus (default 512)"
    )
    tune.add_argument("--top-k", type=int, default=5, help="with --data-dir: chunks retrieved per prompt (default 5)")
    tune.add_argument(
        "--answer-tokens", type=int, default=48, help="with --data-dir: the teacher's answer length limit (default 48)"
    )
    tune.add_argument(
        "--label-share",
        type=float,
        default=None,
        help="with both --data and --data-dir: share of each step's samples that are labelled (default 0.5)",
    )
    tune.add_argument("--steps", type=int, default=100, help="optimiser steps (default 100)")
    tune.add_argument("--batch-size", type=int, default=8, help="samples per optimiser step (default 8)")
    tune.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="samples per forward, gradients accumulated over a step (default: the whole step at once)",
    )
    tune.add_argument(
        "--generate-batch-size", type=int, default=32, help="prompts per batch of teacher answers (default 32)"
    )
    tune.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate (default 2e-5, Block-Attention)")
    tune.add_argument("--warmup-steps", type=int, default=20, help="linear warm-up steps (default 20)")
    tune.add_argument(
        "--full-attention-share",
        type=float,
        default=0.5,
        help="share of samples trained with full causal attention (default 0.5, TurboRAG's 50/50 mix)",
    )
    tune.add_argument(
        "--positions", choices=("reordered", "composite"), default="reordered", help="served positions to train"
    )
    tune.add_argument(
        "--chunk-context",
        choices=("alone", "prefix"),
        default=DEFAULT_CHUNK_CONTEXT,
        help=f"what the served chunks' KV is precomputed after (default {DEFAULT_CHUNK_CONTEXT})",
    )
    tune.add_argument("--lora", action="store_true", help="train LoRA adapters (needs peft), merged before saving")
    tune.add_argument("--device", default=None, help=DEVICE_HELP)
    tune.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weights and optimiser state (default fp32; LoRA base: bf16 on CUDA)",
    )
    tune.add_argument(
        "--compute-dtype",
        choices=DTYPES,
        default=None,
        help="autocast dtype, also saved (default: fp32 on CPU, bf16 on CUDA)",
    )
    tune.add_argument(
        "--instruction",
        default="",
        metavar="TEXT",
        help="added to the system message of every training prompt (default none, as /ask); fine-tune under the "
        "system message you serve or evaluate with",
    )
    tune.add_argument("--seed", type=int, default=0, help="seed of prompts, sample order and mask choice (default 0)")


def _add_make_qa(commands: Any) -> None:
    make_qa = commands.add_parser("make-qa", help="write a synthetic multi-document QA JSONL file")
    make_qa.add_argument("--out", required=True, help="JSONL file to write")
    make_qa.add_argument("--questions", type=int, required=True, help="number of questions")
    make_qa.add_argument("--chunks", type=int, required=True, help="chunks per question (gold, near-miss, distractors)")
    make_qa.add_argument("--seed", type=int, required=True, help="seed; the same seed writes the same bytes")
    make_qa.add_argument(
        "--two-fact-share", type=float, default=0.3, help="share of questions needing two chunks (default 0.3)"
    )


def _add_runtime_options(parser: argparse.ArgumentParser) -> None:
    """Options that override KVSTITCH_* settings for the processes that open the model and stores."""
    parser.add_argument("--model", default=None, help="HF model folder or hub id (KVSTITCH_MODEL)")
    parser.add_argument("--data-dir", default=None, help="data folder (KVSTITCH_DATA_DIR, default ./data)")
    parser.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"), help="KVSTITCH_DEVICE")


def _settings(args: argparse.Namespace) -> Any:
    """Settings from the environment and .env, with the command line's options on top."""
    from service.settings import Settings

    given = {"model": args.model, "data_dir": args.data_dir, "device": args.device}
    for name in ("host", "port", "engines"):
        given[name] = getattr(args, name, None)
    if args.command == "engine":  # its --host/--port are its own, not the gateway's KVSTITCH_HOST/PORT
        given["host"] = given["port"] = None
    if getattr(args, "no_gate", False):
        given["gate_on_start"] = False
    return Settings(**{k: v for k, v in given.items() if v is not None})


def _server_url(args: argparse.Namespace) -> str:
    return str(args.url or os.environ.get("KVSTITCH_URL", "http://127.0.0.1:8000"))


def _dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a --dtype name stands for (None: the command's default)."""
    import torch

    return getattr(torch, name) if name else None


def _on_device(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --device given: cuda when available, else cpu."""
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def _verify(args: argparse.Namespace) -> int:
    from service.engine.engine import StitchEngine
    from service.engine.gate import run_gate
    from service.engine.kv_path import choose_kv_path
    from service.engine.model import UnsupportedModelError, load_model

    args = _on_device(args)
    try:
        model = load_model(args.model, device=args.device, dtype=_dtype(args.dtype))
    except (UnsupportedModelError, OSError, ValueError) as exc:
        print(f"error: cannot load {args.model}: {exc}", file=sys.stderr)
        return 2
    engine = StitchEngine(model, chunk_context=args.chunk_context)
    shared = args.kv_path == "shared"
    if shared:
        path = choose_kv_path("on", model.spec)
        if not path.shared:
            print(f"gate FAIL: the shared path cannot run here: {path.detail}")
            return 1
    result = run_gate(engine, tolerance=args.tolerance, seed=args.seed, shared=shared)
    for path_name, cases in (("copy", result.cases), ("shared", result.shared_cases)):
        for case in cases:
            order = ",".join(str(i) for i in case.order)
            diff = case.max_abs_logit_diff
            print(f"path={path_name} order={order} positions={case.positions.value} max_abs_logit_diff={diff:.3e}")
    passed = result.passed and result.shared_passed is not False
    print(
        f"gate {'pass' if passed else 'FAIL'}: tolerance={result.tolerance:.1e} largest_logit={result.logit_scale:.2f} "
        f"dtype={model.spec.dtype} device={model.spec.device}"
    )
    print(f"max_abs_logit_diff={result.max_abs_logit_diff:.6e}")
    if result.shared_max_abs_logit_diff is not None:
        print(f"zero_copy_max_abs_logit_diff={result.shared_max_abs_logit_diff:.6e}")
    return 0 if passed else 1


def _tiny_model(args: argparse.Namespace) -> int:
    from service.devtools.tiny_model import build_tiny_model

    path = build_tiny_model(args.arch, args.out_dir, seed=args.seed)
    print(f"wrote a tiny random-weight {args.arch} model to {path}")
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    from service.commands.import_gguf import run_import_gguf

    return run_import_gguf(args.file, args.out, args.dtype)


def _eval(args: argparse.Namespace) -> int:
    from service.quality.commands import run_eval

    return run_eval(_on_device(args), _dtype(args.dtype))


def _finetune(args: argparse.Namespace) -> int:
    from service.commands.finetune import run_finetune

    return run_finetune(_on_device(args), _dtype(args.dtype), _dtype(args.compute_dtype))


def _make_qa(args: argparse.Namespace) -> int:
    from service.quality.commands import run_make_qa

    return run_make_qa(args)


def _serve(args: argparse.Namespace) -> int:
    from service.commands.serve import serve, serve_gpus

    if args.gpus is not None:
        if args.engines is not None:
            print("error: --gpus starts its own engines: give it or --engines, not both", file=sys.stderr)
            return 2
        return serve_gpus(_settings(args), args.gpus, args.engine_port)
    return serve(_settings(args))


def _engine(args: argparse.Namespace) -> int:
    from service.commands.engine import run_engine

    return run_engine(_settings(args), args.host, args.port)


def _ask(args: argparse.Namespace) -> int:
    from service.commands.ask import ask

    body = {"question": args.question, "mode": args.mode, "positions": args.positions, "top_k": args.top_k}
    if args.max_new_tokens is not None:
        body["max_new_tokens"] = args.max_new_tokens
    if args.recompute is not None:
        body["recompute"] = args.recompute
    if args.filter is not None:
        try:
            body["filter"] = json.loads(args.filter)
        except ValueError as err:
            print(f"error: --filter is not JSON: {err}", file=sys.stderr)
            return 2
    return ask(_server_url(args), body, args.api_key or os.environ.get("KVSTITCH_API_KEY"))


def _documents(args: argparse.Namespace) -> int:
    from service.commands.documents import (
        MAX_LIMIT,
        MAX_OFFSET,
        DocumentsClient,
        ServerError,
        delete_document,
        list_documents,
        show_document,
    )

    for option, value, low, high in (("--offset", args.offset, 0, MAX_OFFSET), ("--limit", args.limit, 1, MAX_LIMIT)):
        if not low <= value <= high:
            print(f"error: {option} must be {low}-{high:,}, got {value}", file=sys.stderr)
            return 2
    url = _server_url(argparse.Namespace(url=getattr(args, "url", None)))
    client = DocumentsClient(url, getattr(args, "api_key", None) or os.environ.get("KVSTITCH_API_KEY"))
    as_json = bool(getattr(args, "json", False))
    try:
        if args.action == "show":
            return show_document(client, args.doc_id, as_json, sys.stdout)
        if args.action == "delete":
            return delete_document(client, args.doc_id, args.wait, sys.stdout)
        return list_documents(client, args.offset, args.limit, as_json, sys.stdout)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _worker(args: argparse.Namespace) -> int:
    from workers.__main__ import run_worker

    logging.getLogger().setLevel(logging.INFO)
    return run_worker(_settings(args), name=args.name)


def _print_skipped(skipped: object) -> None:
    """A file a folder walk left out, on stderr (stdout keeps the jobs' report)."""
    print(skipped, file=sys.stderr)


def _ingest(args: argparse.Namespace) -> int:
    from service.commands.ingest import InputError, collect_documents, ingest_embedded, ingest_remote

    if args.batch < 1:
        print("error: --batch must be at least 1", file=sys.stderr)
        return 2
    settings = _settings(args)
    try:
        documents = collect_documents(args.paths, settings.max_document_chars, on_skip=_print_skipped)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.embedded:
        return ingest_embedded(documents, settings, min(args.batch, settings.max_documents_per_job))
    try:
        return ingest_remote(documents, _server_url(args), args.api_key or settings.api_key, args.batch)
    except (RuntimeError, OSError) as err:  # httpx's connection errors are OSErrors underneath
        print(f"error: {err}", file=sys.stderr)
        return 1


def _cancel(args: argparse.Namespace) -> int:
    from service.commands.ingest import cancel_remote

    try:
        return cancel_remote(args.job_id, _server_url(args), args.api_key or os.environ.get("KVSTITCH_API_KEY"))
    except RuntimeError as err:  # unknown job, already finished, server away
        print(f"error: {err}", file=sys.stderr)
        return 1


def _into_a_pipe(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command whose output may go to a reader that stops early (`kvstitch documents show X | head`): when
    the reader is gone, stop quietly (status 1), without a BrokenPipeError traceback. The flush is inside the guard
    (the last lines are written there), and stdout then points at devnull, so the interpreter's own flush at exit
    does not raise again (the recipe of Python's `signal` documentation)."""
    try:
        code = handler(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor (captured) has none to swap
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvstitch` console script."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    handlers = {
        "serve": _serve,
        "engine": _engine,
        "ask": _ask,
        "worker": _worker,
        "ingest": _ingest,
        "documents": _documents,
        "cancel": _cancel,
        "verify": _verify,
        "tiny-model": _tiny_model,
        "import-gguf": _import_gguf,
        "eval": _eval,
        "finetune": _finetune,
        "make-qa": _make_qa,
    }
    try:
        if args.command in CLIENT_COMMANDS:
            return _into_a_pipe(handlers[args.command], args)
        return handlers[args.command](args)
    except DataDirInUseError as err:  # one line, not a traceback: the user runs the other process somewhere
        print(f"kvstitch: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
