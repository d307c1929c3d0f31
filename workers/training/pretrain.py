"""A base model trained from scratch on the synthetic QA task: its tokenizer, its config, its training loop.

No pretrained weights can be downloaded where kvstitch is developed, so the quality demonstration (issue 13)
trains its own. The model learns the task under full causal attention only, on prompts built exactly as the
service builds them (`template.prompt` over ids, answer after the assistant header, then EOS), so it is the
papers' "vanilla" RAG model: what turbo mode changes is measured on it, then recovered by block fine-tuning.

Tokenizer: byte-level BPE trained on the training text, with a prefix space added to every piece (so a word is
one token id whether it opens a chunk, follows a space, or opens the answer: copying a year or a name from a
chunk into the answer is then an identity, not a learnt mapping), the tiny models' ChatML template and special
tokens, and the two document markers as single tokens. EOS is `<|im_end|>`, the end of the assistant's turn.

Training: batches padded on the right (positions 0..N-1 of each sequence, as the naive prefill runs it; pads come
after every real token, so the causal mask alone keeps them out), loss on the answer and EOS tokens only (logits
are computed only there: the vocabulary projection of every prompt token would be most of the work), bf16
autocast on CUDA over fp32 weights, AdamW with a linear warm-up and a cosine decay. With a time budget the step
count is fixed after a few timed steps (budget / step time) and once more from a longer average, so the cosine
schedule still ends where training does.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config

from service.devtools.tiny_model import CHATML_TEMPLATE, SPECIAL_TOKENS
from service.engine.prompt import DOC_CLOSE, DOC_OPEN, DOCS_INTRO, DOCS_OUTRO, SYSTEM_TEXT, PromptTemplate
from service.quality.dataset import QASample
from workers.training.finetune import IGNORE, Encoded, answer_separator, sequence_and_labels

log = logging.getLogger(__name__)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DOC_TOKENS = [DOC_OPEN, DOC_CLOSE.strip()]  # single tokens; the newline after the closing marker stays text
TEMPLATE_WEIGHT = 1000  # copies of the template text in the tokenizer's training text
WARM_STEPS = 10  # untimed steps first: the allocator and the kernels' first calls make them slow
TIMING_STEPS = 40  # steps then timed to turn a time budget into a step count
RETIME_STEP = 250  # the count is fixed again here, from the longer average (the first estimate ran 20-50% high)
RETIME_EVERY = 250  # and every this many steps after, from the last window alone (the curriculum's steps are shorter)
OVERRUN = 1.1  # a budgeted run stops at this share of its budget even if the step count is not reached


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2-config decoder; the defaults are the demonstration's (~20M parameters with a 4K vocabulary)."""

    layers: int = 6
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1408
    max_positions: int = 1024
    tied_embeddings: bool = True  # the output matrix is the input embedding, so copying a token is one mapping


def template_texts() -> list[str]:
    """The prompt template's constant text, so the tokenizer learns it too."""
    return [SYSTEM_TEXT, DOCS_INTRO, DOCS_OUTRO, "system", "user", "assistant"]


def corpus(samples: Iterable[QASample]) -> Iterator[str]:
    """Every text the model will read or write: chunks, questions, answers, and the template (weighted, since
    every prompt holds it: its words become whole tokens and the prompt stays short)."""
    for _ in range(TEMPLATE_WEIGHT):
        yield from template_texts()
    for sample in samples:
        yield from sample.chunks
        yield sample.question
        yield from sample.answers


def build_qa_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """A byte-level BPE fitted to `texts` (any text still round-trips), with the chat template and markers."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *DOC_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_base_model(tokenizer: PreTrainedTokenizerFast, shape: ModelShape, seed: int = 0) -> Any:
    """A randomly initialised Qwen2 causal LM (fp32) sized by `shape`, ending answers with the tokenizer's EOS."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        use_sliding_window=False,
        tie_word_embeddings=shape.tied_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)
    return model


def save_untrained(out: str | Path, shape: ModelShape, samples: Sequence[QASample], vocab_size: int, seed: int) -> Path:
    """Write the tokenizer and the random model as an HF folder (then loaded back through `load_model`)."""
    folder = Path(out)
    tokenizer = build_qa_tokenizer(corpus(samples), vocab_size)
    model = build_base_model(tokenizer, shape, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def parameter_count(hf: Any) -> int:
    return sum(p.numel() for p in hf.parameters())


@dataclass(frozen=True)
class PretrainConfig:
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine ends at this share of `lr`
    weight_decay: float = 0.1
    context_weight: float = 0.0  # weight of a next-token loss on the prompt beside the answer loss (0: answer only)
    curriculum_share: float = 0.0  # this share of the steps draws only from the samples with the fewest chunks
    probe_every: int = 0  # steps between held-out exact-match probes (0: none)
    steps: int | None = None  # a fixed step count, or
    seconds: float | None = None  # a time budget (the step count is then derived from the measured step time)
    seed: int = 0

    def check(self) -> None:
        if (self.steps is None) == (self.seconds is None):
            raise ValueError("give exactly one of steps and seconds")
        if self.steps is not None and self.steps < 1:
            raise ValueError("steps must be at least 1")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError("seconds must be positive")
        if self.batch_size < 1 or not self.lr > 0 or self.warmup_steps < 0:
            raise ValueError("batch_size must be at least 1, lr positive, warmup_steps at least 0")
        if not 0.0 <= self.curriculum_share <= 1.0:
            raise ValueError("curriculum_share must be within 0..1")


@dataclass
class PretrainReport:
    steps: int = 0
    seconds: float = 0.0
    step_ms: float = 0.0
    losses: list[float] = field(default_factory=list)  # the answer loss of each step
    probes: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out exact match)

    def loss_curve(self, points: int = 20) -> list[tuple[int, float]]:
        """(last step, mean loss) over `points` equal spans of the run: the curve without 5,000 numbers."""
        span = max(1, math.ceil(len(self.losses) / points))
        return [
            (min(i + span, len(self.losses)), sum(self.losses[i : i + span]) / len(self.losses[i : i + span]))
            for i in range(0, len(self.losses), span)
        ]


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, N], padded on the right
    attention_mask: torch.Tensor  # [B, N], 1 for real tokens
    targets: torch.Tensor  # [B, N - 1]: the token each position predicts, IGNORE where there is no loss


def collate(sequences: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> Batch:
    """Right-padded batch of (input_ids, labels) pairs; padded places carry no loss and are masked out."""
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, (seq_ids, seq_labels) in enumerate(sequences):
        ids[row, : len(seq_ids)] = seq_ids
        labels[row, : len(seq_labels)] = seq_labels
        mask[row, : len(seq_ids)] = 1
    return Batch(ids, mask, labels[:, 1:])


def answer_loss(
    hf: Any, batch: Batch, device: torch.device, compute: torch.dtype, context_weight: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to train on, the answer loss): the mean cross-entropy of the answer and EOS tokens under full
    causal attention at plain positions; with `context_weight` > 0 the loss to train on adds that weight times
    the next-token loss over the prompt (off by default)."""
    targets = batch.targets.to(device)
    with torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32):
        # No padding mask: padding is on the right, so under the causal mask no real token sees a pad, and SDPA
        # keeps its fused causal kernel.
        hidden = hf.model(input_ids=batch.input_ids.to(device), use_cache=False).last_hidden_state[:, :-1]
        where = targets != IGNORE
        logits = hf.lm_head(hidden[where])
        answer = torch.nn.functional.cross_entropy(logits.float(), targets[where])
        if context_weight <= 0:
            return answer, answer
        prompt = (batch.attention_mask[:, 1:].to(device) == 1) & ~where
        context_logits = hf.lm_head(hidden[prompt])
        next_ids = batch.input_ids[:, 1:].to(device)[prompt]
        context = torch.nn.functional.cross_entropy(context_logits.float(), next_ids)
    return answer + context_weight * context, answer


def lr_at(step: int, total: int, config: PretrainConfig) -> float:
    """Linear warm-up to `lr`, then a cosine down to `min_lr_ratio * lr` at `total`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, total - config.warmup_steps))
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def encode_batch(
    tokenizer: PreTrainedTokenizerFast, template: PromptTemplate, samples: Sequence[QASample], max_context: int
) -> list[Encoded]:
    """What `finetune.encode_samples` builds (each text encoded on its own, no special tokens, joined as ids by
    `template.prompt`), with the texts encoded in one batched call: 100,000 samples in seconds, not a minute.
    Samples longer than `max_context` (prompt, answer and EOS) raise ValueError."""
    separator = answer_separator(template, tokenizer)
    texts = [text for s in samples for text in (*s.chunks, s.question, separator + s.answers[0])]
    # The Rust tokenizer directly: the Python wrapper's batch call takes twice as long for the same ids.
    ids = iter(e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
    encoded = []
    for sample in samples:
        chunks = [tuple(next(ids)) for _ in sample.chunks]
        prompt = template.prompt(chunks, tuple(next(ids)))
        answer = tuple(next(ids))
        if len(prompt.joined()) + len(answer) + 1 > max_context:
            raise ValueError(f"line {sample.line}: the sample does not fit the model's {max_context} positions")
        encoded.append(Encoded(prompt, answer))
    return encoded


def training_pairs(encoded: Sequence[Encoded], eos: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) of each sample as `finetune`'s full-attention sample builds it."""
    return [sequence_and_labels(item.prompt, item.answer, eos) for item in encoded]


@torch.no_grad()
def exact_match(hf: Any, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], pad: int, batch_size: int = 64) -> float:
    """Share of samples whose every answer token and EOS is the argmax given the tokens before it: exactly the
    samples that greedy decoding answers with the reference answer and then stops (teacher forcing gives the
    same logits as decoding while every earlier token was right), in one batched forward instead of a decode."""
    device = next(hf.parameters()).device
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    was_training = hf.training
    hf.eval()
    right = 0
    for start in range(0, len(pairs), batch_size):
        batch = collate(pairs[start : start + batch_size], pad)
        targets = batch.targets.to(device)
        with torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32):
            hidden = hf.model(input_ids=batch.input_ids.to(device), use_cache=False).last_hidden_state[:, :-1]
            where = targets != IGNORE
            hits = torch.ones_like(targets, dtype=torch.bool)
            hits[where] = hf.lm_head(hidden[where]).argmax(-1) == targets[where]
        right += int(hits.all(dim=-1).sum())
    hf.train(was_training)
    return right / max(1, len(pairs))


def curriculum_pool(encoded: Sequence[Encoded]) -> list[int]:
    """Indices of the samples with the fewest chunks: lookup among two chunks is learnt before among five."""
    fewest = min(len(e.prompt.blocks) for e in encoded)
    return [i for i, e in enumerate(encoded) if len(e.prompt.blocks) == fewest]


def pretrain(
    hf: Any,
    encoded: Sequence[Encoded],
    eos: int,
    pad: int,
    config: PretrainConfig,
    held_out: Sequence[Encoded] = (),
) -> PretrainReport:
    """Train `hf` (fp32 weights, in place) on the samples; the report holds every step's loss and, every
    `config.probe_every` steps, the exact-match accuracy on `held_out` (the lookup shows there, not in the loss)."""
    config.check()
    device = next(hf.parameters()).device
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    pairs = training_pairs(encoded, eos)
    probe_pairs = training_pairs(held_out, eos)
    everything, easy = range(len(pairs)), curriculum_pool(encoded)
    decay = [p for n, p in hf.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in hf.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    optimiser = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    hf.train()
    report = PretrainReport()
    total = config.steps or 10**9  # a time budget fixes it after the timing steps
    budget = StepBudget(config.seconds, device) if config.seconds is not None else None
    pending: list[torch.Tensor] = []
    began = time.perf_counter()
    step = 0
    while step < total:
        if budget is not None:
            total = budget.steps(step, total)
            if budget.overrun(step):
                log.warning("pretrain: over budget at step %d of %d; stopping", step, total)
                break
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step, total, config)
        pool = easy if step < config.curriculum_share * total else everything
        batch = collate([pairs[i] for i in rng.sample(pool, min(config.batch_size, len(pool)))], pad)
        loss, answer = answer_loss(hf, batch, device, compute, config.context_weight)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimiser.step()
        pending.append(answer.detach())
        step += 1
        if len(pending) == 50 or step >= total:  # read losses back in groups: a sync per step stalls the GPU
            _collect(pending, report)
            log.info("pretrain step %d/%d loss %.4f", step, total, report.losses[-1])
        if probe_pairs and config.probe_every and (step % config.probe_every == 0 or step >= total):
            report.probes.append((step, exact_match(hf, probe_pairs, pad)))
            log.info("pretrain step %d: held-out exact match %.3f", step, report.probes[-1][1])
    _collect(pending, report)
    _synchronize(device)
    hf.eval()
    report.steps = step
    report.seconds = time.perf_counter() - began
    report.step_ms = report.seconds / max(step, 1) * 1e3
    return report


def _collect(pending: list[torch.Tensor], report: PretrainReport) -> None:
    if pending:
        report.losses.extend(float(v) for v in torch.stack(pending).cpu())
        pending.clear()


class StepBudget:
    """Turns a time budget into a step count: untimed warm steps, a first estimate from the timing steps, then
    a new one every `RETIME_EVERY` steps from the last window's step time alone, so a phase of shorter steps
    (the one-chunk curriculum) does not leave the count too high and the cosine unfinished when time runs out."""

    def __init__(self, seconds: float, device: torch.device) -> None:
        self.seconds = seconds
        self.device = device
        self.began = time.perf_counter()
        self.mark = (0, self.began)  # (step, time) where the current timing window opened

    def steps(self, step: int, total: int) -> int:
        """The step count to run, given the one so far, before `step` starts."""
        if step == WARM_STEPS:
            self.mark = (step, self._now())
        elif self.is_timing_point(step) and step < total:
            now = self._now()
            step_s = (now - self.mark[1]) / (step - self.mark[0])
            self.mark = (step, now)
            total = step + max(0, int((self.seconds - (now - self.began)) / step_s))
            log.info("pretrain: %.1f ms per step, %d steps fit in %.0f s", step_s * 1e3, total, self.seconds)
            return max(total, step + 1)  # the step under way runs
        return total

    @staticmethod
    def is_timing_point(step: int) -> bool:
        later = step >= RETIME_STEP and (step - RETIME_STEP) % RETIME_EVERY == 0
        return step == WARM_STEPS + TIMING_STEPS or later

    def overrun(self, step: int) -> bool:
        """Past `OVERRUN` times the budget: stop whatever the count says (the estimate can still be short)."""
        return step > WARM_STEPS + TIMING_STEPS and time.perf_counter() - self.began > OVERRUN * self.seconds

    def _now(self) -> float:
        _synchronize(self.device)
        return time.perf_counter()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
