"""Time to first token: naive vs stitched eager vs stitched with the CUDA-graph question prefill (issue 7).

    python -m loadtest.bench_ttft --contexts 4096 8192 16384 --runs 9 --json ttft.json

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (see bench_prefill). TTFT
is wall clock from "ids and chunk KV handed to the engine" to "first token id on the host", synchronised, median
of --runs after --warmup, all in one process on the same ids:

- naive: one causal prefill over prefix + chunks + question;
- stitched eager: chunk KV on the GPU, rotate + place into a fresh buffer, eager question prefill;
- stitched graph: lease the capacity bucket's graph, stitch into its buffer, replay the question's prefill graph
  (what the scheduler's prefill of one request does with `cuda_graphs` on); from the GPU tier, from pinned host
  blocks (a plain copy inside the stitch), and, with the KV cache importable, from `KVStore`'s pinned host tier
  with overlapped copies (`fetch(overlap=True)` + `chunk_ready`, as the gateway does).

On the KVStore host tier the engine pipelines by default (§8.2): the fetch copies the host blocks layer group by
layer group and the question prefill runs as one graph segment per group, each after its group's stitch, so the
copies of group g + 1 overlap segment g. The host tier is timed with pipelining off too (blocks copied whole, stitch,
one-graph prefill) and with each of --pipeline-groups.

The stitch runs through the fused Triton rotate-and-place where triton imports (the engine's default on CUDA);
the torch stitch is timed beside it (stitch alone, graph TTFT from the GPU and the KVStore host tier), and the
fused stitch's one-launch variant (every copy waited for first) on the KVStore host tier.

Also per context: stitch-only and prefill-only times of both paths, the capture time of the prefill graph
(a fresh capture: the once-per-bucket start-up cost), and the largest |graph - eager|
first-token logit difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_prefill import (
    add_workload_arguments,
    build_engine,
    context_chunks,
    precompute_all,
    question_ids,
    timed,
)
from service.engine.cuda_graph import LayerGroups, PrefillGraph, layer_groups, question_bucket
from service.engine.engine import StitchEngine
from service.engine.fused_stitch import FusedStitch
from service.engine.kv_layout import KVBlock
from service.engine.prompt import PromptIds
from service.engine.stitch import BlockReady
from service.kvcache import device

log = logging.getLogger("bench_ttft")
Fetch = Callable[[], tuple[list[KVBlock], list[BlockReady | None] | None]]


def first_token(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def graphed(engine: StitchEngine, prompt: PromptIds, extra: int, fetch: Fetch) -> Callable[[], int]:
    """One turbo TTFT through the graphs: lease, (fetch,) stitch into the graph's buffer, prefill graph, argmax."""
    question = prompt.question

    def run() -> int:
        graph = engine.lease_graph(prompt.context_tokens, len(question), extra)
        if graph is None:
            raise RuntimeError("no graph leased: are CUDA graphs on and the bucket free?")
        try:
            blocks, ready = fetch()
            _, logits, _ = engine.prefill_stitched(blocks, question, extra_tokens=extra, chunk_ready=ready, graph=graph)
            return first_token(logits)
        finally:
            engine.release_graph(graph)

    return run


def with_attribute(target: Any, name: str, value: Any, run: Callable[[], Any]) -> Callable[[], Any]:
    """`run` with `target.name` set to `value` for its duration (restored afterwards, whatever happens)."""

    def switched() -> Any:
        saved = getattr(target, name)
        setattr(target, name, value)
        try:
            return run()
        finally:
            setattr(target, name, saved)

    return switched


def stitch_with(engine: StitchEngine, fused: FusedStitch | None, run: Callable[[], Any]) -> Callable[[], Any]:
    """`run` with the engine's stitch switched to `fused` (None: the torch stitch)."""
    return with_attribute(engine, "fused_stitch", fused, run)


def one_launch(fused: FusedStitch | None, run: Callable[[], Any]) -> Callable[[], Any]:
    """`run` with the fused stitch waiting for every block's copy, then launching once."""
    return run if fused is None else with_attribute(fused, "overlap", False, run)


def pipelined_with(engine: StitchEngine, groups: LayerGroups | None, run: Callable[[], Any]) -> Callable[[], Any]:
    """`run` with the engine's pipeline layer groups set to `groups` (None: no pipelining)."""
    return with_attribute(engine, "pipeline_layers", groups, run)


def kvstore_host_fetch(
    engine: StitchEngine, prompt: PromptIds, cache_dir: Path, args: argparse.Namespace
) -> tuple[Any, Fetch] | None:
    """A fetch served by `KVStore`'s pinned host tier with overlapped copies, or None where the KV cache does not
    import (its index module needs the redis package)."""
    try:
        from loadtest.bench_tiers import Bench
        from service.kvcache.tiers import Tier
    except ImportError as err:
        log.warning("KVStore host tier skipped: %s", err)
        return None
    bench = Bench(engine, prompt, cache_dir, args)
    store = bench.warm["host"]
    store.fetch(prompt.blocks)  # disk → host tier

    def fetch() -> tuple[list[KVBlock], list[BlockReady | None] | None]:
        result = store.fetch(prompt.blocks, overlap=True)
        if result.counts[Tier.HOST] != len(prompt.blocks):
            raise RuntimeError(f"expected every block from the host tier, got {result.counts}")
        return result.blocks, list(result.ready)

    return bench, fetch


def bench_context(engine: StitchEngine, context: int, args: argparse.Namespace, cache_dir: Path) -> dict[str, Any]:
    chunks = context_chunks(engine, context, args.chunk_tokens, seed=context)
    prompt = engine.template.prompt(chunks, question_ids(engine, args.question_tokens))
    question, extra, target = prompt.question, args.answer_tokens, engine.spec.device
    gpu_kv, _ = precompute_all(engine, list(prompt.blocks), args.precompute_batch)
    host_kv = [KVBlock(b.token_ids, b.kv.cpu().pin_memory()) for b in gpu_kv]
    runs, warmup = args.runs, args.warmup

    # Fresh captures for this context's bucket, timed: what a server pays once per bucket.
    graphs = engine.stitch_graphs
    assert graphs is not None
    graph = engine.lease_graph(prompt.context_tokens, len(question), extra)
    assert graph is not None
    bucket = question_bucket(len(question))
    assert bucket is not None
    prefill_graph = graph.prefill_graph(bucket)
    engine.release_graph(graph)

    # Correctness on the real shape: graph vs eager first-token logits.
    _, eager_logits, _ = engine.prefill_stitched(gpu_kv, question, extra_tokens=extra)
    graph = engine.lease_graph(prompt.context_tokens, len(question), extra)
    assert graph is not None
    _, graph_logits, plan = engine.prefill_stitched(gpu_kv, question, extra_tokens=extra, graph=graph)
    engine.release_graph(graph)

    def stitch_graph() -> None:
        engine.stitch(gpu_kv, "reordered", len(question) + extra, into=graph.buffer)

    def prefill_graph_only() -> int:
        graph.buffer.truncate(plan.context_tokens, plan.question_start)
        logits = graph.prefill(question)
        assert logits is not None
        return first_token(logits)

    # The same prefill graph with one causal flash call over the whole context instead of split key ranges.
    single = PrefillGraph(engine.forward, graph.buffer.data, graph.capacity, bucket, graph.attention, None, 1)

    def prefill_single_only() -> int:
        graph.buffer.truncate(plan.context_tokens, plan.question_start)
        logits = single.replay(question, plan.question_start, plan.context_tokens)
        graph.buffer.commit(len(question), plan.question_start + len(question))
        return first_token(logits)

    eager_buffer, eager_plan = engine.stitch(gpu_kv, "reordered", len(question) + extra)
    fused = engine.fused_stitch
    torch_buffer, _ = stitch_with(engine, None, lambda: engine.stitch(gpu_kv, "reordered", len(question) + extra))()
    used = eager_plan.context_tokens
    fused_equal = torch.equal(eager_buffer.data[:, :, :, :used], torch_buffer.data[:, :, :, :used])
    fused_diff = float(
        (eager_buffer.data[:, :, :, :used].float() - torch_buffer.data[:, :, :, :used].float()).abs().max()
    )
    del torch_buffer

    def prefill_eager_only() -> int:
        eager_buffer.truncate(eager_plan.context_tokens, eager_plan.question_start)
        return first_token(engine.prefill_question(eager_buffer, question))

    row: dict[str, Any] = {
        "context_tokens": prompt.context_tokens,
        "question_tokens": len(question),
        "question_bucket": bucket,
        "graph_capacity": graph.capacity,
        "prefill_capture_ms": prefill_graph.capture_ms,
        "max_logit_diff_graph_vs_eager": float((graph_logits - eager_logits).abs().max()),
        "fused_stitch": fused is not None,
        "fused_equals_torch_stitch": fused_equal,
        "max_abs_diff_fused_vs_torch_stitch": fused_diff,
        "same_first_token": first_token(graph_logits) == first_token(eager_logits),
        "naive_ms": timed(lambda: first_token(engine.prefill_naive(prompt)[1]), runs, warmup, target),
        "stitched_eager_gpu_ms": timed(
            lambda: first_token(engine.prefill_stitched(gpu_kv, question, extra_tokens=extra)[1]), runs, warmup, target
        ),
        "stitched_graph_gpu_ms": timed(graphed(engine, prompt, extra, lambda: (gpu_kv, None)), runs, warmup, target),
        "stitched_graph_host_plain_ms": timed(
            graphed(engine, prompt, extra, lambda: (host_kv, None)), runs, warmup, target
        ),
        "stitch_eager_only_ms": timed(
            lambda: engine.stitch(gpu_kv, "reordered", len(question) + extra), runs, warmup, target
        ),
        "stitch_graph_only_ms": timed(stitch_graph, runs, warmup, target),
        "stitch_torch_eager_only_ms": timed(
            stitch_with(engine, None, lambda: engine.stitch(gpu_kv, "reordered", len(question) + extra)),
            runs,
            warmup,
            target,
        ),
        "stitch_torch_graph_only_ms": timed(stitch_with(engine, None, stitch_graph), runs, warmup, target),
        "stitched_graph_gpu_torch_stitch_ms": timed(
            stitch_with(engine, None, graphed(engine, prompt, extra, lambda: (gpu_kv, None))), runs, warmup, target
        ),
        "prefill_eager_only_ms": timed(prefill_eager_only, runs, warmup, target),
        "prefill_graph_only_ms": timed(prefill_graph_only, runs, warmup, target),
        "prefill_graph_one_flash_call_ms": timed(prefill_single_only, runs, warmup, target),
        "prefill_kv_splits": prefill_graph.kv_splits,
    }
    if not args.no_kvstore:
        found = kvstore_host_fetch(engine, prompt, cache_dir / f"ctx{context}", args)
        if found is not None:
            bench, fetch = found
            try:
                run_host = graphed(engine, prompt, extra, fetch)
                row["pipeline_groups"] = engine.pipeline_layers
                row["stitched_graph_kvstore_host_ms"] = timed(run_host, runs, warmup, target)
                unpipelined = pipelined_with(engine, None, run_host)
                row["stitched_graph_kvstore_host_unpipelined_ms"] = timed(unpipelined, runs, warmup, target)
                firsts = {first_token(engine.prefill_stitched(gpu_kv, question)[1]), run_host(), unpipelined()}
                for count in args.pipeline_groups:
                    groups = layer_groups(engine.spec.num_layers, count)
                    run_groups = pipelined_with(engine, groups, run_host)
                    row[f"stitched_graph_kvstore_host_pipelined_{count}_ms"] = timed(run_groups, runs, warmup, target)
                    firsts.add(run_groups())
                row["pipelined_same_first_token"] = len(firsts) == 1
                if not args.pipeline_only:
                    row["stitched_graph_kvstore_host_torch_stitch_ms"] = timed(
                        stitch_with(engine, None, unpipelined), runs, warmup, target
                    )
                    row["stitched_graph_kvstore_host_one_launch_ms"] = timed(
                        one_launch(fused, unpipelined), runs, warmup, target
                    )
            finally:
                bench.close()
    return {**row, **{f"median_{k}": statistics.median(v) for k, v in row.items() if isinstance(v, list)}}


def _ms(row: dict[str, Any], key: str) -> str:
    value = row.get(f"median_{key}")
    return "—" if value is None else f"{value:.2f}"


def stitch_table(rows: list[dict[str, Any]]) -> str:
    """Fused vs torch stitch: the stitch alone and the graph TTFT each gives."""
    lines = [
        "| context | stitch torch / fused, fresh buffer ms | stitch torch / fused, graph buffer ms | graph TTFT GPU "
        "tier torch / fused ms | graph TTFT KVStore host torch / fused (one launch) ms | fused == torch |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context_tokens']} | {_ms(r, 'stitch_torch_eager_only_ms')} / {_ms(r, 'stitch_eager_only_ms')} "
            f"| {_ms(r, 'stitch_torch_graph_only_ms')} / {_ms(r, 'stitch_graph_only_ms')} "
            f"| {_ms(r, 'stitched_graph_gpu_torch_stitch_ms')} / {_ms(r, 'stitched_graph_gpu_ms')} "
            f"| {_ms(r, 'stitched_graph_kvstore_host_torch_stitch_ms')} / {_ms(r, 'stitched_graph_kvstore_host_ms')}"
            f" ({_ms(r, 'stitched_graph_kvstore_host_one_launch_ms')}) "
            f"| {r['fused_equals_torch_stitch']} ({r['max_abs_diff_fused_vs_torch_stitch']:.2g}) |"
        )
    return "\n".join(lines)


def pipeline_table(rows: list[dict[str, Any]], counts: list[int]) -> str:
    """KVStore host-tier graph TTFT with and without layer pipelining."""
    head = " | ".join(f"pipelined, {c} groups ms" for c in counts)
    lines = [
        f"| context | naive ms | GPU tier ms | host tier, not pipelined ms | **host tier, pipelined (default) ms** | "
        f"{head} | vs naive | same first token |",
        "|---|---|---|---|---|" + "---|" * len(counts) + "---|---|",
    ]
    for r in rows:
        best = r.get("median_stitched_graph_kvstore_host_ms")
        ratio = "—" if best is None else f"{r['median_naive_ms'] / best:.1f}x"
        cells = " | ".join(_ms(r, f"stitched_graph_kvstore_host_pipelined_{c}_ms") for c in counts)
        lines.append(
            f"| {r['context_tokens']} | {r['median_naive_ms']:.1f} | {_ms(r, 'stitched_graph_gpu_ms')} "
            f"| {_ms(r, 'stitched_graph_kvstore_host_unpipelined_ms')} "
            f"| **{_ms(r, 'stitched_graph_kvstore_host_ms')}** "
            f"| {cells} | {ratio} | {r.get('pipelined_same_first_token', '—')} |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| context | naive ms | stitched eager, GPU ms | stitched graph, GPU ms | vs naive | graph, pinned host "
        "(plain copy) ms | graph, KVStore host tier ms | stitch only eager / graph buffer ms | question prefill "
        "eager / graph (one flash call) ms | capture prefill ms | max logit diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kvstore = r.get("median_stitched_graph_kvstore_host_ms")
        lines.append(
            f"| {r['context_tokens']} | {r['median_naive_ms']:.1f} | {r['median_stitched_eager_gpu_ms']:.1f} "
            f"| {r['median_stitched_graph_gpu_ms']:.2f} "
            f"| {r['median_naive_ms'] / r['median_stitched_graph_gpu_ms']:.0f}x "
            f"| {r['median_stitched_graph_host_plain_ms']:.2f} | {'—' if kvstore is None else f'{kvstore:.2f}'} "
            f"| {r['median_stitch_eager_only_ms']:.2f} / {r['median_stitch_graph_only_ms']:.2f} "
            f"| {r['median_prefill_eager_only_ms']:.2f} / {r['median_prefill_graph_only_ms']:.2f} "
            f"({r['median_prefill_graph_one_flash_call_ms']:.2f}) "
            f"| {r['prefill_capture_ms']:.0f} "
            f"| {r['max_logit_diff_graph_vs_eager']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--answer-tokens", type=int, default=256, help="answer budget (sizes the graph's bucket)")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-kvstore", action="store_true", help="skip the KVStore host-tier column")
    parser.add_argument("--cache-dir", type=Path, default=None, help="parent of the KVStore's files (/var/tmp)")
    parser.add_argument(
        "--pipeline-groups", type=int, nargs="*", default=[2, 4, 7], help="layer-group counts timed on the host tier"
    )
    parser.add_argument(
        "--pipeline-only", action="store_true", help="skip the torch-stitch and one-launch host-tier columns"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.runs < 7:
        parser.error("--runs must be at least 7")
    if not torch.cuda.is_available():
        log.error("the CUDA-graph prefill needs a CUDA device")
        return 2
    engine = build_engine(args.model, torch.device("cuda"))
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    parent = args.cache_dir or Path("/var/tmp")
    parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvstitch-bench-ttft-", dir=parent) as tmp:
        for context in args.contexts:
            row = bench_context(engine, context, args, Path(tmp))
            report["rows"].append(row)
            log.info("%s", json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}))
            device.synchronize(engine.spec.device)
            torch.cuda.empty_cache()
    report["seconds"] = time.perf_counter() - started
    tables = [table(report["rows"]), stitch_table(report["rows"]), pipeline_table(report["rows"], args.pipeline_groups)]
    sys.stdout.write("\n\n".join(tables) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
