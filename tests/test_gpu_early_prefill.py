"""Early prefills on CUDA (`pytest -m gpu tests/test_gpu_early_prefill.py`): questions joining running answers
are admitted and prefilled on the side stream, beside the running step, through the prefill graphs. Every token and
text is that of the same early prefills run on the one stream (the same kernels in the same order: bf16, exact), so
nothing the two streams share is read before it is written. (Against the riding run, whose steps have other GEMM
shapes, bf16 tokens may part at a near tie: only the counts are compared.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.devtools.tiny_model import CHATML_TEMPLATE, build_tokenizer
from service.engine.engine import StitchEngine
from service.engine.inflight import PendingPicks
from service.engine.model import LoadedModel, spec_from_config
from service.engine.scheduler import Scheduler
from tests.test_engine_shared_mixed_graph import NEEDS_GPU, sums_in_one_order
from tests.test_engine_shared_scheduler import (
    ASKS,
    Ask,
    Run,
    assert_nothing_pinned,
    block_sizes,
    join_one_by_one,
    nan_arena,
    nan_pool,
)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_early_prefills_on_the_side_stream_decode_the_riding_runs_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = get_engine(arch, "cuda")
    sums_in_one_order(monkeypatch)

    def run(early_below: int, one_stream: bool = False) -> tuple[list[tuple[list[int], str, str]], int, int, bool]:
        arena = nan_arena(engine, sum(block_sizes(engine)))
        scheduler = Scheduler(
            engine,
            nan_pool(engine, 4000),
            8,
            overlap=True,
            cuda_graphs=True,
            arena=arena,
            prefill_with_decode=True,
            early_prefill_below=early_below,
        )
        side = scheduler.runner.side
        if one_stream and side is not None:  # the side stream's work on the main stream, in program order
            side._stream, side._cuda = None, False
        requests = Run(engine, ASKS)
        join_one_by_one(scheduler, requests.requests)
        assert scheduler.shared is not None
        scheduler.shared.close()
        assert_nothing_pinned(scheduler)
        on_side = side is not None and side._stream is not None
        return requests.outcomes(), scheduler.prefilled_early, scheduler.prefilled_with_decode, on_side

    riding, early_none, rode, _ = run(0)
    in_order, _, _, in_order_on_side = run(8, one_stream=True)
    early, prefilled_early, rode_early, on_side = run(8)
    assert (early_none, rode) == (0, 3) and (prefilled_early, rode_early) == (3, 0)
    assert on_side and not in_order_on_side
    assert early == in_order
    assert [len(tokens) for tokens, _, _ in early] == [len(tokens) for tokens, _, _ in riding]


STUCK_LOOKS = 100_000  # looks at one step's picks (~20 s of 0.2 ms polls): the device no longer advances


def stress_asks(count: int) -> list[Ask]:
    """`count` shared asks over the corpus's chunks, of several lengths, each with its own question."""
    reads = ((0, 1, 2), (2, 0), (0, 3), (2, 4, 0), (1,), (4, 2), (3, 1, 0), ())
    return [
        Ask(reads[i % len(reads)], max_new=4 + (i * 7) % 17, seed=100 + i, question=5 + i % 9) for i in range(count)
    ]


def stuck_guard(monkeypatch: pytest.MonkeyPatch, scheduler: Scheduler) -> None:
    """A step whose picks never arrive fails the test with where each stream stands, instead of hanging it."""
    looks: dict[int, int] = {}
    real_ready = PendingPicks.ready

    def ready(self: PendingPicks) -> bool:
        if real_ready(self):
            return True
        looks[id(self)] = looks.get(id(self), 0) + 1
        if looks[id(self)] > STUCK_LOOKS:
            side = scheduler.runner.side
            side_done = side is None or side._stream is None or side._stream.query()
            raise AssertionError(
                f"a step never ended: main stream done {torch.cuda.current_stream().query()}, "
                f"side stream done {side_done}, record side={self.side} rows={len(self.batch)}"
            )
        return False

    monkeypatch.setattr(PendingPicks, "ready", ready)


@pytest.fixture(scope="module")
def wide_engine() -> StitchEngine:
    """Qwen2-7B's widths (hidden 3,584, MLP 18,944, 28 / 4 heads), two layers, the tiny tokenizer's vocabulary,
    random bf16 weights built on the GPU: its GEMMs are the served model's, the ones cuBLAS splits along K (whose
    reductions go through its workspace); the tiny model's are not."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE
    shape = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4}
    config = Qwen2Config(
        **shape, num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=4096, rope_theta=1e6
    )
    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.eval().requires_grad_(False)
    spec = spec_from_config(config, torch.bfloat16, device)
    return StitchEngine(LoadedModel(hf, tokenizer, spec, "random:qwen2-7b-wide-2-layers", "qwen2-7b-wide-2-layers"))


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ("tiny", "wide"))
def test_answers_handed_over_mid_step_are_prefilled_early_without_stalling_the_device(
    get_engine: Callable[[str, str], StitchEngine],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
) -> None:
    """The engine loop's way: answers handed over one at a look while steps run (`Scheduler.arrivals`), and some
    at a step's start, through the captured graphs on both streams (question prefills on the side beside decode
    steps on the main). Every answer ends with all its tokens and the device never stalls (`stuck_guard`): with
    the two graph families captured on one stream, their GEMMs shared a cuBLAS workspace and a served 7B-shaped
    model stalled within seconds. (Tokens are not compared: the batches' make-up follows the device's timing, and
    bf16 rows in other GEMM shapes may part at a near tie.)"""
    engine = get_engine("qwen2", "cuda") if model == "tiny" else request.getfixturevalue("wide_engine")
    asks = stress_asks(32)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(
        engine,
        nan_pool(engine, 8000),
        16,
        overlap=True,
        cuda_graphs=True,
        arena=arena,
        prefill_with_decode=True,
        early_prefill_below=64,
    )
    stuck_guard(monkeypatch, scheduler)
    run = Run(engine, asks)
    handed = list(reversed(run.requests[2:]))
    scheduler.arrivals = lambda: [handed.pop()] if handed else []
    for request_ in run.requests[:2]:
        scheduler.add(request_)
    for step in range(5000):
        if not handed and not scheduler.has_work():
            break
        if handed and (step % 3 == 0 or not scheduler.has_work()):  # some at a step's start, the rest mid-step
            scheduler.add(handed.pop())
        scheduler.step()
    assert not handed and not scheduler.has_work()
    assert scheduler.shared is not None
    scheduler.shared.close()
    assert_nothing_pinned(scheduler)
    assert scheduler.prefilled_early > 0
    outcomes = run.outcomes()
    assert [len(tokens) for tokens, _, _ in outcomes] == [ask.max_new for ask in asks]
    assert all(reason == "length" for _, _, reason in outcomes)
