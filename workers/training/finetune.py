"""Block fine-tuning (Block-Attention §2.4, TurboRAG §3.3): train the model on the attention it is served with.

A sample is prefix + chunk blocks + question suffix + answer + EOS, as token ids joined exactly as the engine
serves them (`template.prompt`). Its mask is the reference's independent mask (`reference.independent_mask`):
the prefix causal, each chunk only itself, the question and the answer everything before them. Its positions are
the served ones (`plan_positions` of the chosen mode for the context; the tail at its true index). The loss is
on the answer and its EOS only.

With probability `full_attention_share` a sample instead uses full causal attention and plain positions: the
naive path stays the service's baseline and fallback, so the model must keep answering well under it too.
TurboRAG trains on 50% document QA under its masks and 50% general data under the standard mask (appendix D);
with only QA data here, 0.5 gives the same balance between the two attention patterns. Block-Attention's
published recipe is all-block (share 0), which `--full-attention-share 0` reproduces.

Optimiser as in Block-Attention: AdamW, lr 2e-5, linear warm-up over the first 20 steps. Precision as the
papers' bf16 training runs it (mixed): matmuls in the device's serving dtype (bf16 on CUDA through autocast, fp32
on CPU) over fp32 master weights, because an AdamW step of 2e-5 is below bf16's resolution (2^-8 relative) for
most weights and would round away. With LoRA the frozen base stays in the serving dtype (peft keeps adapters in
fp32). The folder is saved in the serving dtype, which is what `load_model` would cast it to anyway.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.engine.model import LoadedModel, default_dtype, load_model
from service.engine.prompt import PromptIds, PromptTemplate, build_template, encode
from service.engine.reference import independent_mask
from service.engine.stitch import PositionMode, plan_positions
from service.quality.dataset import QADataError, QASample, read_samples

log = logging.getLogger(__name__)

IGNORE = -100  # label of tokens without loss (cross_entropy's ignore_index)
DEFAULT_FULL_ATTENTION_SHARE = 0.5
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
REPORT_NAME = "kvstitch_finetune.json"


class FinetuneError(ValueError):
    """Fine-tuning cannot start: a bad option, a missing optional package, unusable data."""


@dataclass(frozen=True)
class FinetuneConfig:
    model: str
    data: str
    out: str
    steps: int = 100
    lr: float = 2e-5
    batch_size: int = 8
    warmup_steps: int = 20
    full_attention_share: float = DEFAULT_FULL_ATTENTION_SHARE
    positions: PositionMode = PositionMode.REORDERED
    lora: bool = False
    device: str = "cpu"
    dtype: torch.dtype | None = None  # weights and optimiser state; None: see `choose_precision`
    compute_dtype: torch.dtype | None = None  # matmuls (autocast); None: the device's serving dtype
    seed: int = 0

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.warmup_steps < 0:
            raise FinetuneError("--steps and --batch-size must be at least 1, --warmup-steps at least 0")
        if not self.lr > 0:
            raise FinetuneError("--lr must be positive")
        if not 0.0 <= self.full_attention_share <= 1.0:
            raise FinetuneError("--full-attention-share must be within 0..1")


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


@dataclass(frozen=True)
class TrainingSample:
    """One sequence with its mask, positions and labels, all [N] (the mask [N, N], True: may attend)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    allowed: torch.Tensor
    labels: torch.Tensor


@dataclass
class FinetuneReport:
    out: str
    losses: list[float] = field(default_factory=list)
    block_samples: int = 0
    full_attention_samples: int = 0


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


def _tail_ids(prompt: PromptIds, answer: Sequence[int], eos: int) -> list[int]:
    return [*prompt.joined(), *answer, eos]


def _labels(prompt: PromptIds, answer: Sequence[int], eos: int) -> torch.Tensor:
    ids = _tail_ids(prompt, answer, eos)
    labels = torch.full((len(ids),), IGNORE, dtype=torch.long)
    start = len(prompt.joined())
    labels[start:] = torch.tensor(ids[start:])
    return labels


def block_sample(
    prompt: PromptIds, answer: Sequence[int], eos: int, positions: PositionMode = PositionMode.REORDERED
) -> TrainingSample:
    """The sample under the served attention: the reference's independent mask and the stitch plan's positions."""
    lengths = [len(prompt.prefix), *(len(b) for b in prompt.blocks)]
    tail = len(prompt.question) + len(answer) + 1
    plan = plan_positions(positions, lengths)
    context = plan.context_tokens
    return TrainingSample(
        input_ids=torch.tensor(_tail_ids(prompt, answer, eos)),
        positions=torch.cat([plan.positions(), torch.arange(context, context + tail)]),
        allowed=independent_mask(lengths, tail),
        labels=_labels(prompt, answer, eos),
    )


def full_attention_sample(prompt: PromptIds, answer: Sequence[int], eos: int) -> TrainingSample:
    """The sample as an ordinary causal sequence at positions 0..N-1 (the naive path)."""
    ids, labels = sequence_and_labels(prompt, answer, eos)
    size = len(ids)
    return TrainingSample(
        input_ids=ids,
        positions=torch.arange(size),
        allowed=torch.ones(size, size, dtype=torch.bool).tril(),
        labels=labels,
    )


def sequence_and_labels(prompt: PromptIds, answer: Sequence[int], eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of prompt + answer + EOS, the labels IGNORE over the prompt: what a padded batch
    needs, without the [N, N] mask of a `TrainingSample`."""
    return torch.tensor(_tail_ids(prompt, answer, eos)), _labels(prompt, answer, eos)


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
    """Mean cross-entropy of the answer tokens (and EOS), each predicted from the token before it."""
    with torch.autocast(device.type, dtype=precision.compute, enabled=precision.autocast):
        logits = forward_logits(hf, sample, device, precision.compute)
    targets = sample.labels.to(device)
    return torch.nn.functional.cross_entropy(logits[:-1].float(), targets[1:], ignore_index=IGNORE)


@dataclass(frozen=True)
class Encoded:
    """A QA sample as ids: its prompt and the answer the model learns (the first listed)."""

    prompt: PromptIds
    answer: tuple[int, ...]


def encode_samples(
    model: LoadedModel, template: PromptTemplate, samples: Sequence[QASample], source: str
) -> list[Encoded]:
    """Ids of every sample, chunks encoded like the chunker does; QADataError when one exceeds the context."""
    tokenizer, encoded = model.tokenizer, []
    for sample in samples:
        chunks = [encode(tokenizer, c) for c in sample.chunks]
        prompt = template.prompt(chunks, encode(tokenizer, sample.question))
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


def finetune(config: FinetuneConfig) -> FinetuneReport:
    """Block fine-tune `config.model` on `config.data` and save an HF folder to `config.out`."""
    config.check()
    if config.lora:
        import_peft()  # before minutes of loading, not after
    samples = read_samples(config.data)
    precision = choose_precision(config)
    model = load_model(config.model, device=config.device, dtype=precision.weights)
    template = build_template(model.tokenizer)
    encoded = encode_samples(model, template, samples, Path(config.data).name)
    hf = with_lora(model.hf) if config.lora else model.hf.requires_grad_(True)
    hf.train()
    report = train(hf, model, encoded, config, precision)
    if config.lora:
        hf = hf.merge_and_unload()
    save(hf.eval().to(precision.compute), model, config, report)
    return report


def train(
    hf: Any, model: LoadedModel, encoded: Sequence[Encoded], config: FinetuneConfig, precision: Precision
) -> FinetuneReport:
    """`config.steps` optimiser steps of `config.batch_size` samples each (gradients accumulated)."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    params = [p for p in hf.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    warmup = max(config.warmup_steps, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: min(1.0, (step + 1) / warmup))
    report, eos = FinetuneReport(config.out), eos_id(model)
    device = model.spec.device
    order = batches(len(encoded), config.batch_size, rng)
    for step in range(config.steps):
        optimiser.zero_grad(set_to_none=True)
        total = 0.0
        for index in next(order):
            sample = _draw(encoded[index], eos, config, rng, report)
            loss = sample_loss(hf, sample, device, precision) / config.batch_size
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        schedule.step()
        report.losses.append(total)
        log.info("step %d/%d loss %.4f", step + 1, config.steps, total)
    return report


def _draw(
    item: Encoded, eos: int, config: FinetuneConfig, rng: random.Random, report: FinetuneReport
) -> TrainingSample:
    """The block sample, or with probability `full_attention_share` the full-attention one (counted)."""
    if rng.random() < config.full_attention_share:
        report.full_attention_samples += 1
        return full_attention_sample(item.prompt, item.answer, eos)
    report.block_samples += 1
    return block_sample(item.prompt, item.answer, eos, config.positions)


def save(hf: Any, model: LoadedModel, config: FinetuneConfig, report: FinetuneReport) -> None:
    """An HF folder `load_model` opens (weights, config, generation config, tokenizer) and the run's record."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    model.tokenizer.save_pretrained(out)
    settings = {k: (str(v) if not isinstance(v, int | float | bool | None) else v) for k, v in asdict(config).items()}
    record = {"config": settings, **asdict(report)}
    (out / REPORT_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
