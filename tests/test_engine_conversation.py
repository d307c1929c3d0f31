"""A conversation after the stitched chunks: built from ids through the chat template, and still the reference.

The suffix of a prompt with history is the only part prefilled; the stitched context before it must give the
same logits and the same greedy answer as one forward of the HF model under the independent mask, as for a lone
question (`test_engine_stitch.py`), and the naive baseline reads the very same ids.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_engine_batch import drain, nan_pool
from test_engine_stitch import _assert_decode_follows_reference, tolerance

from service.engine.batch_request import BatchRequest
from service.engine.conversation import Turn
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.prompt import PromptIds
from service.engine.reference import prompt_reference_logits, reference_greedy
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.stitch import PositionMode


def conversation(engine: StitchEngine) -> list[Turn]:
    encode = engine.encode_question
    return [
        Turn("system", encode("Answer in one word.")),
        Turn("user", encode("Who wrote the license?")),
        Turn("assistant", encode("The Apache foundation.")),
        Turn("user", encode("And who holds its copyright?")),
    ]


def history_prompt(engine: StitchEngine, seed: int) -> PromptIds:
    chunks = synthetic_ids(engine, (19, 7, 26), seed=seed)
    blocks = tuple(engine.template.chunk_block(c) for c in chunks)
    return PromptIds(engine.template.prefix, blocks, engine.conversation.suffix(conversation(engine)))


def test_one_question_is_the_plain_prompt(get_engine: Callable[..., StitchEngine], arch: str) -> None:
    engine = get_engine(arch, "cpu")
    question = engine.encode_question("Capital of France?")

    assert engine.conversation.suffix([Turn("user", question)]) == engine.template.question_suffix(question)


def test_every_message_is_in_the_suffix_in_order_as_its_own_ids(
    get_engine: Callable[..., StitchEngine], arch: str
) -> None:
    """The first question is asked in the documents' turn; the others follow in order; each message's ids appear
    whole (encoded alone, never re-tokenized with its neighbours), and the last piece opens the answer."""
    engine = get_engine(arch, "cpu")
    turns = conversation(engine)
    suffix = list(engine.conversation.suffix(turns))
    head = engine.template.question_head
    first = turns[1].ids

    assert suffix[: len(head) + len(first)] == [*head, *first]
    found, at = [], 0
    for turn in (turns[0], turns[2], turns[3]):
        at = next(i for i in range(at, len(suffix)) if tuple(suffix[i : i + len(turn.ids)]) == turn.ids)
        found.append(at)
        at += len(turn.ids)
    assert found == sorted(found)
    tail = engine.template.question_tail
    assert tuple(suffix[-len(tail) :]) == tail


def test_the_chat_template_gives_each_role_its_turn(get_engine: Callable[..., StitchEngine]) -> None:
    qwen = get_engine("qwen2", "cpu")
    text = qwen.tokenizer.decode(list(qwen.conversation.suffix(conversation(qwen))))
    assert "Question: Who wrote the license?<|im_end|>\n<|im_start|>system\nAnswer in one word.<|im_end|>" in text
    assert "<|im_start|>assistant\nThe Apache foundation.<|im_end|>\n<|im_start|>user\nAnd who holds" in text
    assert text.endswith("copyright?<|im_end|>\n<|im_start|>assistant\n")
    mistral = get_engine("mistral", "cpu")  # no chat template: labelled lines, then the plain answer cue
    text = mistral.tokenizer.decode(list(mistral.conversation.suffix(conversation(mistral))))
    assert text.endswith(
        "Question: Who wrote the license?\nInstruction: Answer in one word.\nAnswer: The Apache foundation."
        "\nQuestion: And who holds its copyright?\nAnswer:"
    )


def test_a_conversation_must_end_with_the_question(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    with pytest.raises(ValueError, match="ends with the new question"):
        engine.conversation.suffix(conversation(engine)[:-1])


@pytest.mark.parametrize("positions", list(PositionMode))
def test_stitched_with_history_equals_reference(engine: StitchEngine, positions: PositionMode) -> None:
    prompt = history_prompt(engine, seed=5)
    kv = engine.precompute(prompt.blocks)

    _, stitched, _ = engine.prefill_stitched(kv, prompt.question, positions, all_logits=True)

    reference = prompt_reference_logits(engine.model, prompt, positions)[-len(prompt.question) :]
    assert float((stitched - reference).abs().max()) <= tolerance(engine)


@pytest.mark.parametrize("positions", list(PositionMode))
def test_turbo_answer_with_history_equals_reference(engine: StitchEngine, positions: PositionMode) -> None:
    """Through the scheduler, as the server answers: chunk KV reused, history and question prefilled, decoded."""
    prompt = history_prompt(engine, seed=6)
    request = BatchRequest(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), "turbo", positions)
    scheduler = Scheduler(engine, nan_pool(engine, 600))
    scheduler.add(request)
    drain(scheduler)

    tokens = request.result.token_ids
    assert len(tokens) == 12 and request.result.prompt_tokens == len(prompt.joined())
    if engine.spec.dtype == torch.float32:
        assert tokens == reference_greedy(engine.model, prompt, positions, steps=12)
    _assert_decode_follows_reference(engine, prompt, tokens, positions)


def test_naive_with_history_reads_the_same_ids(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    prompt = history_prompt(engine, seed=7)
    _, naive = engine.prefill_naive(prompt, all_logits=True)
    ids = torch.tensor([prompt.joined()])
    with torch.inference_mode():
        hf = engine.model.hf(input_ids=ids).logits[0].float()
    assert float((naive - hf).abs().max()) <= tolerance(engine)
