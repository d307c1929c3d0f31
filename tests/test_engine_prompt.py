"""The prompt is built by joining token ids; the pieces come from the chat template when there is one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from service.engine.engine import StitchEngine


@pytest.fixture
def cpu_engine(get_engine: Callable[..., StitchEngine], arch: str) -> StitchEngine:
    return get_engine(arch, "cpu")


def test_joined_ids_are_the_parts_in_order(cpu_engine: StitchEngine) -> None:
    tok = cpu_engine.tokenizer
    chunk_ids = [tok.encode(t, add_special_tokens=False) for t in ("Paris is in France.", " Berlin, Germany")]
    prompt = cpu_engine.template.prompt(chunk_ids, cpu_engine.encode_question("Capital of France?"))
    expected = list(prompt.prefix)
    for block, chunk in zip(prompt.blocks, chunk_ids, strict=True):
        assert list(block) == [*cpu_engine.template.doc_open, *chunk, *cpu_engine.template.doc_close]
        expected += block
    expected += prompt.question
    assert prompt.joined() == expected
    assert prompt.context_tokens == len(expected) - len(prompt.question)


def test_chunk_blocks_carry_no_bos(cpu_engine: StitchEngine) -> None:
    block = cpu_engine.template.chunk_block([5, 6, 7])
    assert cpu_engine.tokenizer.bos_token_id not in block
    assert cpu_engine.tokenizer.decode(list(block)).startswith("<|doc_start|>")


def test_template_pieces_follow_the_chat_template(get_engine: Callable[..., StitchEngine]) -> None:
    qwen = get_engine("qwen2", "cpu")
    text = qwen.tokenizer.decode(list(qwen.template.prefix))
    assert text.startswith("<|im_start|>system\nYou are an accurate and reliable AI assistant")
    assert qwen.tokenizer.decode(list(qwen.template.question_tail)).endswith("<|im_start|>assistant\n")
    llama = get_engine("llama", "cpu")
    assert llama.template.prefix[0] == llama.tokenizer.bos_token_id
    assert llama.tokenizer.decode(list(llama.template.question_tail)).endswith("assistant<|end_header_id|>\n\n")
    mistral = get_engine("mistral", "cpu")  # no chat template: the plain fallback
    assert mistral.template.prefix[0] == mistral.tokenizer.bos_token_id
    assert mistral.tokenizer.decode(list(mistral.template.question_tail)) == "\nAnswer:"
    versions = {e.template.version for e in (qwen, llama, mistral)}
    assert len(versions) == 3


def test_question_ids_are_not_retokenized(cpu_engine: StitchEngine) -> None:
    question = cpu_engine.encode_question("How far is 🚀 from Käse?")
    suffix = cpu_engine.template.question_suffix(question)
    head = len(cpu_engine.template.question_head)
    assert list(suffix[head : head + len(question)]) == list(question)


def test_empty_pieces_are_refused(cpu_engine: StitchEngine) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        cpu_engine.template.chunk_block([])
    with pytest.raises(ValueError, match="at least one token"):
        cpu_engine.template.question_suffix([])
