"""Block fine-tuning (Block-Attention §2.4, TurboRAG §3.3): train the model on the attention it is served with.

A sample is prefix + chunk blocks + question suffix + the tokens learnt after it, as token ids joined exactly
as the engine serves them (`template.prompt`). Its mask is the reference's independent mask
(`reference.independent_mask`, called in `attention_sample` alone): the prefix causal, each chunk only itself, the
question and the answer everything before them. Its positions are the served ones (`plan_positions` of the
chosen mode for the context; the tail at its true index). The loss is on the learnt tokens only.

Two kinds of samples, mixed per step by `label_share`:
- labelled QA (`--data`): cross-entropy on the reference answer and EOS;
- self-distillation (`--data-dir`): prompts made from the user's ingested corpus (`corpus_prompts.py`), the
  targets the starting model's own greedy answers under full attention, the loss KL(teacher || student) on each
  answer token's next-token distribution, the teacher a frozen copy of the starting weights (`distill.py`). No
  labels, so no answer style is learnt (labelled QA taught the synthetic answers' style and cost naive accuracy
  on real passages).

With probability `full_attention_share` a sample instead uses full causal attention and plain positions: the
naive path stays the service's baseline and fallback, so the model must keep answering well under it too.
TurboRAG trains on 50% document QA under its masks and 50% general data under the standard mask (appendix D);
0.5 gives the same balance between the two attention patterns. Block-Attention's published recipe is all-block
(share 0), which `--full-attention-share 0` reproduces. Under distillation a full-attention sample starts at KL 0
and anchors the naive path to the teacher.

Speed: a step's samples are padded into batches (`batch.py`: one [B, 1, L, L] additive mask holding each
sample's own mask, logits only where there is a loss), in micro-batches of `micro_batch_size` sorted by length;
samples are drawn in length buckets (`bucketed_batches`) so a batch pads little. Losses are read back every few
steps, not every step. The result equals the one-sample-at-a-time loop it replaced (`sample_loss`, kept for the
tests and `loadtest/bench_finetune.py`) to float tolerance.

Optimiser as in Block-Attention: AdamW (fused on CUDA), lr 2e-5, linear warm-up over the first 20 steps.
Precision as the papers' bf16 training runs it (mixed): matmuls in the device's serving dtype (bf16 on CUDA
through autocast, fp32 on CPU) over fp32 master weights, because an AdamW step of 2e-5 is below bf16's resolution
(2^-8 relative) for most weights and would round away. With LoRA the frozen base stays in the serving dtype (peft
keeps adapters in fp32). The folder is saved in the serving dtype, which is what `load_model` would cast it to.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.engine.kv_layout import ChunkContext
from service.engine.model import LoadedModel, default_dtype, load_model
from service.engine.prompt import PromptIds, PromptTemplate, build_template, encode, encode_text
from service.engine.reference import independent_mask
from service.engine.stitch import PositionMode, plan_positions
from service.quality.dataset import QADataError, QASample, read_samples
from service.settings import MAX_INSTRUCTION_CHARS
from workers.training.batch import IGNORE, TrainingSample, collate, sample_losses
from workers.training.distill import FrozenTeacher, stop_ids

__all__ = ["IGNORE", "TrainingSample"]  # re-exported: the pretraining code and the tests import them from here

log = logging.getLogger(__name__)

DEFAULT_FULL_ATTENTION_SHARE = 0.5
DEFAULT_LABEL_SHARE = 0.5  # with both --data and --data-dir: half of each step's samples labelled
DEFAULT_PROMPTS = 512
DEFAULT_ANSWER_TOKENS = 48
DEFAULT_TOP_K = 5  # /ask's default
BUCKET_BATCHES = 8  # samples are sorted by length within windows of this many batches
LOSS_READ_EVERY = 20  # steps between reading the losses back (each read waits for the device)
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
REPORT_NAME = "kvstitch_finetune.json"
PREVIEW = 5  # corpus questions and teacher answers kept in the report


class FinetuneError(ValueError):
    """Fine-tuning cannot start: a bad option, a missing optional package, unusable data."""


@dataclass(frozen=True)
class FinetuneConfig:
    model: str
    data: str | None  # labelled QA JSONL (cross-entropy)
    out: str
    data_dir: str | None = None  # an ingested corpus: prompts for self-distillation
    distill_data: str | None = None  # a QA JSONL whose questions and chunks are distillation prompts (answers unused)
    prompts: int = DEFAULT_PROMPTS  # distillation prompts made from the corpus
    top_k: int = DEFAULT_TOP_K
    answer_tokens: int = DEFAULT_ANSWER_TOKENS  # the teacher's greedy answers' length limit
    label_share: float | None = None  # None: DEFAULT_LABEL_SHARE with both sources, else the one source given
    steps: int = 100
    lr: float = 2e-5
    batch_size: int = 8
    micro_batch_size: int | None = None  # samples per forward; None: the whole step at once
    generate_batch_size: int = 32
    warmup_steps: int = 20
    full_attention_share: float = DEFAULT_FULL_ATTENTION_SHARE
    positions: PositionMode = PositionMode.REORDERED
    chunk_context: ChunkContext = ChunkContext.ALONE  # what the served chunks' KV is precomputed after
    lora: bool = False
    device: str = "cpu"
    dtype: torch.dtype | None = None  # weights and optimiser state; None: see `choose_precision`
    compute_dtype: torch.dtype | None = None  # matmuls (autocast); None: the device's serving dtype
    seed: int = 0
    # Added to the system message of every training prompt: train under the system message the model is served
    # (or evaluated) with, so the teacher answers in the style that message asks for.
    instruction: str = ""

    def check(self) -> None:
        if self.data is None and not self.distills:
            raise FinetuneError(
                "give --data FILE.jsonl (labelled QA), --data-dir DIR (an ingested corpus) or --distill-data FILE.jsonl"
            )
        if self.steps < 1 or self.batch_size < 1 or self.warmup_steps < 0:
            raise FinetuneError("--steps and --batch-size must be at least 1, --warmup-steps at least 0")
        if (self.micro_batch_size or 1) < 1 or self.generate_batch_size < 1:
            raise FinetuneError("--micro-batch-size and --generate-batch-size must be at least 1")
        if not self.lr > 0:
            raise FinetuneError("--lr must be positive")
        if not 0.0 <= self.full_attention_share <= 1.0:
            raise FinetuneError("--full-attention-share must be within 0..1")
        if self.label_share is not None and not 0.0 <= self.label_share <= 1.0:
            raise FinetuneError("--label-share must be within 0..1")
        if self.prompts < 1 or self.top_k < 1 or self.answer_tokens < 1:
            raise FinetuneError("--prompts, --top-k and --answer-tokens must be at least 1")
        if len(self.instruction) > MAX_INSTRUCTION_CHARS:
            raise FinetuneError(
                f"--instruction has {len(self.instruction)} characters; at most {MAX_INSTRUCTION_CHARS}"
            )

    @property
    def distills(self) -> bool:
        """Whether any self-distillation prompts are given (a corpus, a prompts file)."""
        return self.data_dir is not None or self.distill_data is not None

    def labelled_per_step(self) -> int:
        """How many of a step's samples come from the labelled file; the rest are distillation samples."""
        if not self.distills:
            return self.batch_size
        if self.data is None:
            return 0
        share = DEFAULT_LABEL_SHARE if self.label_share is None else self.label_share
        return round(share * self.batch_size)


@dataclass(frozen=True)
class Precision:
    weights: torch.dtype  # parameters, gradients and optimiser state
    compute: torch.dtype  # the forward and backward (autocast where it differs from `weights`), and the save

    @property
    def autocast(self) -> bool:
        return self.compute != self.weights


def choose_precision(config: FinetuneConfig) -> Precision:
    """fp32 master weights for full fine-tuning, the serving dtype for a LoRA base; compute in the serving dtype."""
    serving = default_dtype(torch.device(config.device))
    weights = config.dtype or (serving if config.lora else torch.float32)
    return Precision(weights, config.compute_dtype or serving)


@dataclass
class FinetuneReport:
    out: str
    losses: list[float] = field(default_factory=list)
    block_samples: int = 0
    full_attention_samples: int = 0
    labelled_samples: int = 0
    distill_samples: int = 0
    distill_prompts: int = 0
    teacher_seconds: float = 0.0  # generating the teacher's answers
    # the first few corpus questions with the teacher's answers, so the run's record shows what was learnt
    distill_preview: list[dict[str, str]] = field(default_factory=list)
    train_seconds: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return (self.block_samples + self.full_attention_samples) / self.train_seconds if self.train_seconds else 0.0


def answer_ids(template: PromptTemplate, tokenizer: Any, answer: str) -> tuple[int, ...]:
    """The answer's ids as the model should generate them after the question suffix.

    Chat templates end the suffix with a newline (the assistant header) and the answer follows directly; the
    plain template ends with "Answer:", after which a space separates the answer, as in ordinary text.
    """
    return encode(tokenizer, answer_separator(template, tokenizer) + answer)


def answer_separator(template: PromptTemplate, tokenizer: Any) -> str:
    """What comes between the question suffix and the answer's text: nothing after a chat template's newline,
    a space after the plain template's "Answer:"."""
    tail = tokenizer.decode(list(template.question_tail))
    return "" if not tail or tail[-1].isspace() else " "


def _labels(prompt: PromptIds, target: Sequence[int]) -> torch.Tensor:
    start = len(prompt.joined())
    labels = torch.full((start + len(target),), IGNORE, dtype=torch.long)
    labels[start:] = torch.tensor(list(target), dtype=torch.long)
    return labels


def attention_sample(
    prompt: PromptIds,
    target: Sequence[int],
    positions: PositionMode | None,
    distill: bool = False,
    context: ChunkContext = ChunkContext.ALONE,
) -> TrainingSample:
    """prompt + target under the served attention (`positions` a mode: the independent mask and the stitch
    plan's positions, chunks precomputed after `context`) or under full causal attention at 0..N-1 (`positions`
    None, the naive path)."""
    ids = torch.tensor([*prompt.joined(), *target], dtype=torch.long)
    size = len(ids)
    if positions is None:
        allowed = torch.ones(size, size, dtype=torch.bool).tril()
        return TrainingSample(ids, torch.arange(size), allowed, _labels(prompt, target), distill)
    after_prefix = context is ChunkContext.PREFIX
    if after_prefix and PositionMode(positions) is PositionMode.REORDERED:
        return moved_chunks_sample(prompt, target, distill)
    lengths = [len(prompt.prefix), *(len(b) for b in prompt.blocks)]
    tail = len(prompt.question) + len(target)
    plan = plan_positions(positions, lengths, len(prompt.prefix) if after_prefix else 0)
    start = plan.context_tokens
    served = torch.cat([plan.positions(), torch.arange(start, start + tail)])
    allowed = independent_mask(lengths, tail, prefix_visible=after_prefix)
    return TrainingSample(ids, served, allowed, _labels(prompt, target), distill)


def moved_chunks_sample(prompt: PromptIds, target: Sequence[int], distill: bool) -> TrainingSample:
    """Chunks precomputed after the prefix (at P..) and read at reordered positions, as one forward.

    Served, a chunk's K/V come from prefix + chunk at P.., and its keys are then rotated to its slot: no single
    position per token gives that when the chunk's slot is not P. But RoPE depends only on distances, so a copy of
    the prefix placed right before the chunk (at slot - P .. slot - 1) gives the chunk exactly its precomputed
    K/V, with its keys already at the slot. So the sequence is prefix + chunk 1 (whose slot is P), then a prefix
    copy + chunk for each later chunk, then the tail; each block sees only itself (`independent_mask`), and the
    tail sees the prefix and the chunks but no copy. The teacher reads the prompt without the copies
    (`teacher_ids`)."""
    prefix, blocks = list(prompt.prefix), [list(b) for b in prompt.blocks]
    tail_ids = [*prompt.question, *target]
    segments = [prefix + blocks[0], *(prefix + b for b in blocks[1:])]
    lengths = [len(s) for s in segments]
    allowed = independent_mask(lengths, len(tail_ids))
    copies = torch.zeros(sum(lengths), dtype=torch.bool)
    positions, slot, offset = [], 0, 0
    for index, segment in enumerate(segments):
        first = slot if index == 0 else slot - len(prefix)
        positions.append(torch.arange(first, first + len(segment)))
        if index > 0:
            copies[offset : offset + len(prefix)] = True
        slot += len(segment) if index == 0 else len(segment) - len(prefix)
        offset += len(segment)
    tail_rows = slice(sum(lengths), None)
    allowed[tail_rows, : sum(lengths)] &= ~copies
    positions.append(torch.arange(slot, slot + len(tail_ids)))
    ids = torch.tensor([*(t for s in segments for t in s), *tail_ids], dtype=torch.long)
    labels = torch.full((len(ids),), IGNORE, dtype=torch.long)
    labels[len(ids) - len(target) :] = torch.tensor(list(target), dtype=torch.long)
    teacher = torch.tensor([*prompt.joined(), *target], dtype=torch.long)
    return TrainingSample(ids, torch.cat(positions), allowed, labels, distill, teacher)


def block_sample(
    prompt: PromptIds, answer: Sequence[int], eos: int, positions: PositionMode = PositionMode.REORDERED
) -> TrainingSample:
    """The labelled sample (answer + EOS) under the served attention."""
    return attention_sample(prompt, [*answer, eos], positions)


def full_attention_sample(prompt: PromptIds, answer: Sequence[int], eos: int) -> TrainingSample:
    """The labelled sample (answer + EOS) as an ordinary causal sequence at positions 0..N-1 (the naive path)."""
    return attention_sample(prompt, [*answer, eos], None)


def sequence_and_labels(prompt: PromptIds, answer: Sequence[int], eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of prompt + answer + EOS, the labels IGNORE over the prompt: what a padded batch
    needs, without the [N, N] mask of a `TrainingSample`."""
    target = [*answer, eos]
    return torch.tensor([*prompt.joined(), *target]), _labels(prompt, target)


def forward_logits(hf: Any, sample: TrainingSample, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Logits [N, vocab] of the HF forward under the sample's mask and positions (as `reference_logits` runs it).

    `dtype` is the dtype attention computes in (the mask must match the queries' dtype for SDPA).
    """
    additive = torch.zeros(sample.allowed.shape, dtype=dtype)
    additive.masked_fill_(~sample.allowed, torch.finfo(dtype).min)
    out = hf(
        input_ids=sample.input_ids[None].to(device),
        attention_mask=additive[None, None].to(device),
        position_ids=sample.positions[None].to(device),
        use_cache=False,
    )
    logits: torch.Tensor = out.logits[0]
    return logits


def sample_loss(hf: Any, sample: TrainingSample, device: torch.device, precision: Precision) -> torch.Tensor:
    """Mean cross-entropy of one sample's learnt tokens, each predicted from the token before it: the loop
    `train` ran before batching (one forward and backward per sample), kept as the batched loss's reference."""
    with torch.autocast(device.type, dtype=precision.compute, enabled=precision.autocast):
        logits = forward_logits(hf, sample, device, precision.compute)
    targets = sample.labels.to(device)
    return torch.nn.functional.cross_entropy(logits[:-1].float(), targets[1:], ignore_index=IGNORE)


@dataclass(frozen=True)
class Encoded:
    """A QA sample as ids: its prompt and the answer the model learns (the first listed)."""

    prompt: PromptIds
    answer: tuple[int, ...]


@dataclass(frozen=True)
class Example:
    """A prompt and the tokens learnt after it: a labelled answer and EOS (cross-entropy), or the teacher's
    own answer (`distill`: KL to the teacher)."""

    prompt: PromptIds
    target: tuple[int, ...]
    distill: bool

    @property
    def tokens(self) -> int:
        return len(self.prompt.joined()) + len(self.target)


def encode_samples(
    model: LoadedModel, template: PromptTemplate, samples: Sequence[QASample], source: str
) -> list[Encoded]:
    """Ids of every sample, chunks encoded like the chunker does; QADataError when one exceeds the context."""
    tokenizer, encoded = model.tokenizer, []
    for sample in samples:
        chunks = [encode_text(tokenizer, c) for c in sample.chunks]
        prompt = template.prompt(chunks, encode_text(tokenizer, sample.question))
        answer = answer_ids(template, tokenizer, sample.answers[0])
        size = len(prompt.joined()) + len(answer) + 1
        if size > model.spec.max_context:
            raise QADataError(f"{source} line {sample.line}: {size} tokens exceed the model's context")
        encoded.append(Encoded(prompt, answer))
    return encoded


def batches(count: int, batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless batches of sample indices, reshuffled every epoch."""
    order: list[int] = []
    while True:
        batch: list[int] = []
        while len(batch) < batch_size:
            if not order:
                order = list(range(count))
                rng.shuffle(order)
            batch.append(order.pop())
        yield batch


def bucketed_batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless batches as `batches` draws them, regrouped by length: each window of up to `BUCKET_BATCHES`
    batches is sorted by length and cut again, and the window's batches come in random order. Every sample is
    still drawn once per epoch; a batch then pads to a length near its samples' own."""
    # A window holds at most one epoch: sorting one that spanned several would put copies of a sample side by
    # side, and a batch of a small set could be one sample over and over.
    span = batch_size * max(1, min(BUCKET_BATCHES, len(lengths) // batch_size))
    draw = batches(len(lengths), span, rng)
    while True:
        window = sorted(next(draw), key=lambda i: lengths[i])
        cut = [window[i : i + batch_size] for i in range(0, len(window), batch_size)]
        rng.shuffle(cut)
        yield from cut


def with_lora(hf: Any) -> Any:
    """The model wrapped with LoRA adapters on the attention projections (peft, optional)."""
    peft = import_peft()
    config = peft.LoraConfig(
        r=LORA_RANK,
        lora_alpha=2 * LORA_RANK,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(hf, config)


def import_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise FinetuneError("--lora needs the optional peft package (pip install peft); it is not installed") from None
    return peft


def eos_id(model: LoadedModel) -> int:
    eos = model.tokenizer.eos_token_id
    if not isinstance(eos, int):
        raise FinetuneError(f"the tokenizer of {model.source} has no EOS token to end answers with")
    return eos


def pad_id(model: LoadedModel) -> int:
    pad = model.tokenizer.pad_token_id
    return pad if isinstance(pad, int) else eos_id(model)


def labelled_examples(model: LoadedModel, template: PromptTemplate, path: str) -> list[Example]:
    samples = read_samples(path)
    eos = eos_id(model)
    encoded = encode_samples(model, template, samples, Path(path).name)
    return [Example(e.prompt, (*e.answer, eos), distill=False) for e in encoded]


def corpus_settings(config: FinetuneConfig) -> Any:
    """The settings that open the corpus in `config.data_dir` (the environment's, that folder), `--top-k` checked
    against their bound before any model is loaded."""
    from service.settings import Settings

    try:
        settings = Settings(model=config.model, data_dir=config.data_dir)
    except ValueError as err:  # a KVSTITCH_* variable out of its bounds
        raise FinetuneError(str(err)) from None
    if config.top_k > settings.max_top_k:
        raise FinetuneError(f"--top-k must be within 1..{settings.max_top_k} (KVSTITCH_MAX_TOP_K)")
    return settings


def distill_examples(
    model: LoadedModel,
    template: PromptTemplate,
    teacher: FrozenTeacher,
    config: FinetuneConfig,
    settings: Any,
    report: FinetuneReport,
) -> list[Example]:
    """The distillation prompts (the corpus's, the prompts file's) with the teacher's greedy answers (generated
    here, once); the first few go into the report's preview."""
    questions, prompts = distill_prompts(model, template, config, settings)
    stops = stop_ids(model.tokenizer, model.hf)
    answers = teacher.answers(prompts, stops, config.answer_tokens, config.generate_batch_size, pad_id(model))
    for question, answer in list(zip(questions, answers, strict=True))[:PREVIEW]:
        text = model.tokenizer.decode(list(answer), skip_special_tokens=True)
        report.distill_preview.append({"question": question, "answer": text})
    return [Example(p, a, distill=True) for p, a in zip(prompts, answers, strict=True) if a]


def distill_prompts(
    model: LoadedModel, template: PromptTemplate, config: FinetuneConfig, settings: Any
) -> tuple[list[str], list[PromptIds]]:
    """(questions, prompts) to distil on: made from the corpus (`--data-dir`), then a QA file's questions over its
    chunks (`--distill-data`; its answers are never read: the teacher answers)."""
    questions: list[str] = []
    prompts: list[PromptIds] = []
    if settings is not None:
        from workers.training.corpus_prompts import corpus_prompts

        made = corpus_prompts(
            model, template, settings, config.prompts, config.top_k, config.answer_tokens, config.seed
        )
        questions += [p.question for p in made]
        prompts += [p.prompt for p in made]
    if config.distill_data is not None:
        samples = read_samples(config.distill_data)
        encoded = encode_samples(model, template, samples, Path(config.distill_data).name)
        questions += [s.question for s in samples]
        prompts += [e.prompt for e in encoded]
    return questions, prompts


def training_template(model: LoadedModel, config: FinetuneConfig) -> PromptTemplate:
    """The served template, with `config.instruction` added to its system message."""
    return build_template(model.tokenizer, system_extra=config.instruction)


def finetune(config: FinetuneConfig) -> FinetuneReport:
    """Block fine-tune `config.model` on labelled QA and/or self-distillation over a corpus; save to `config.out`."""
    config.check()
    if config.lora:
        import_peft()  # before minutes of loading, not after
    settings = corpus_settings(config) if config.data_dir is not None else None
    precision = choose_precision(config)
    model = load_model(config.model, device=config.device, dtype=precision.weights)
    template = training_template(model, config)
    labelled = labelled_examples(model, template, config.data) if config.data else []
    report = FinetuneReport(config.out)
    teacher, distilled = None, []
    if config.distills:
        began = time.perf_counter()
        teacher = (
            FrozenTeacher(model.hf, precision.compute)
            if config.lora
            else FrozenTeacher.frozen_copy(model.hf, precision.compute)
        )
        distilled = distill_examples(model, template, teacher, config, settings, report)
        report.teacher_seconds = time.perf_counter() - began
        report.distill_prompts = len(distilled)
    if not labelled and not distilled:
        raise FinetuneError("the teacher answered every distillation prompt with nothing; there is nothing to learn")
    hf = with_lora(model.hf) if config.lora else model.hf.requires_grad_(True)
    if teacher is not None and config.lora:
        teacher.off = hf.disable_adapter
    hf.train()
    train(model.hf, Pools(labelled, distilled), config, precision, report, teacher, pad_id(model))
    if config.lora:
        hf = hf.merge_and_unload()
    save(hf.eval().to(precision.compute), model, config, report)
    return report


@dataclass(frozen=True)
class Pools:
    labelled: Sequence[Example]
    distilled: Sequence[Example]


def _draws(pool: Sequence[Example], per_step: int, rng: random.Random) -> Iterator[list[int]]:
    if per_step == 0 or not pool:
        while True:
            yield []
    yield from bucketed_batches([e.tokens for e in pool], per_step, rng)


def train(
    hf: Any,
    pools: Pools,
    config: FinetuneConfig,
    precision: Precision,
    report: FinetuneReport,
    teacher: FrozenTeacher | None = None,
    pad: int = 0,
) -> FinetuneReport:
    """`config.steps` optimiser steps of `config.batch_size` samples each, in padded micro-batches.

    `hf` is the causal LM whose trainable parameters are stepped (with LoRA, the base with adapters inside)."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    device = next(hf.parameters()).device
    params = [p for p in hf.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, fused=device.type == "cuda")
    warmup = max(config.warmup_steps, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: min(1.0, (step + 1) / warmup))
    labelled_count = config.labelled_per_step() if pools.distilled else config.batch_size
    labelled = _draws(pools.labelled, labelled_count, rng)
    distilled = _draws(pools.distilled, config.batch_size - labelled_count, rng)
    pending: list[torch.Tensor] = []
    began = time.perf_counter()
    for step in range(config.steps):
        chosen = [pools.labelled[i] for i in next(labelled)] + [pools.distilled[i] for i in next(distilled)]
        samples = [draw_sample(example, config, rng, report) for example in chosen]
        optimiser.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for part in micro_batches(samples, config.micro_batch_size):
            losses = sample_losses(hf, collate(part, pad), device, precision.compute, teacher)
            loss = losses.sum() / len(samples)
            loss.backward()  # type: ignore[no-untyped-call]
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        schedule.step()
        pending.append(total)
        if len(pending) == LOSS_READ_EVERY or step + 1 == config.steps:
            report.losses.extend(float(v) for v in torch.stack(pending).cpu())
            pending.clear()
            log.info("step %d/%d loss %.4f", step + 1, config.steps, report.losses[-1])
    report.train_seconds = time.perf_counter() - began
    return report


def micro_batches(samples: Sequence[TrainingSample], size: int | None) -> Iterator[list[TrainingSample]]:
    """The step's samples sorted by length, in runs of `size` (all at once when None)."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids))
    step = size or len(ordered)
    for start in range(0, len(ordered), step):
        yield ordered[start : start + step]


def draw_sample(example: Example, config: FinetuneConfig, rng: random.Random, report: FinetuneReport) -> TrainingSample:
    """The block sample, or with probability `full_attention_share` the full-attention one (counted)."""
    if example.distill:
        report.distill_samples += 1
    else:
        report.labelled_samples += 1
    if rng.random() < config.full_attention_share:
        report.full_attention_samples += 1
        return attention_sample(example.prompt, example.target, None, example.distill)
    report.block_samples += 1
    return attention_sample(example.prompt, example.target, config.positions, example.distill, config.chunk_context)


def save(hf: Any, model: LoadedModel, config: FinetuneConfig, report: FinetuneReport) -> None:
    """An HF folder `load_model` opens (weights, config, generation config, tokenizer) and the run's record."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    model.tokenizer.save_pretrained(out)
    settings = {k: (str(v) if not isinstance(v, int | float | bool | None) else v) for k, v in asdict(config).items()}
    record = {"config": settings, **asdict(report), "samples_per_s": report.samples_per_s}
    (out / REPORT_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
