"""Text deltas never split a character; stop strings and sampling behave as users expect."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.devtools.tiny_model import build_tokenizer
from service.engine.detokenize import IncrementalDetokenizer
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.offline import generate
from service.engine.sampling import Sampler, SamplingParams

MULTIBYTE = "Der Bär isst Käse 東京は日本 🙂🚀 done"


def test_deltas_never_split_a_character() -> None:
    tok = build_tokenizer()
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs tokens that split a character"
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == detok.text


def test_stop_string_across_tokens_is_cut_and_held_back() -> None:
    tok = build_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=["Answer:"])
    shown = ""
    for i in tok.encode("The capital. Answer: Paris", add_special_tokens=False):
        shown += detok.push(i)
        assert "Answ" not in shown  # a partial stop string is never shown
        if detok.stopped:
            break
    assert detok.stopped
    assert shown == detok.text == "The capital. "


def test_partial_stop_prefix_is_released_at_the_end() -> None:
    tok = build_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=["STOPWORD"])
    shown = "".join(detok.push(i) for i in tok.encode("ends with STOP", add_special_tokens=False))
    assert shown == "ends with "
    assert detok.flush() == "STOP"
    assert not detok.stopped


def test_sampler_modes() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert Sampler(SamplingParams(), torch.device("cpu")).pick(logits) == 1
    top1 = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3), torch.device("cpu"))
    assert {top1.pick(logits) for _ in range(20)} == {1}
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=0.4, seed=3), torch.device("cpu"))
    assert {nucleus.pick(logits) for _ in range(50)} == {1}
    wide = Sampler(SamplingParams(temperature=1.0, seed=5), torch.device("cpu"))
    assert len({wide.pick(logits) for _ in range(200)}) >= 3


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_new_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("stop", ("",))],
)
def test_sampling_params_are_bounded(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def _generate(engine: StitchEngine, params: SamplingParams, mode: str = "turbo") -> tuple[list[int], str, str]:
    chunks = synthetic_ids(engine, (12, 20), seed=51)
    prompt = engine.template.prompt(chunks, engine.encode_question("What is it?"))
    deltas: list[str] = []
    result = generate(engine, prompt, params, mode=mode, on_text=deltas.append)
    assert "".join(deltas) == result.text  # the streamed text is the answer's
    return result.token_ids, result.text, result.finish_reason


def test_seeded_sampling_is_reproducible(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    first, second = _generate(engine, params), _generate(engine, params)
    assert first == second
    other = _generate(engine, SamplingParams(max_new_tokens=12, temperature=1.0, seed=8, ignore_eos=True))
    assert other[0] != first[0]


def test_generation_stops_on_eos_and_reports_length(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("llama", "cpu")
    ids, text, reason = _generate(engine, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert (len(ids), reason) == (5, "length")
    eos = engine.tokenizer.eos_token_id
    # Make EOS the only choice: the stream must stop after one token with reason "stop".
    bias = torch.zeros(engine.spec.vocab_size)
    bias[eos] = 1e4
    with torch.no_grad():
        engine.model.hf.lm_head.bias = torch.nn.Parameter(bias)
        try:
            ids, text, reason = _generate(engine, SamplingParams(max_new_tokens=5))
        finally:
            engine.model.hf.lm_head.bias = None
    assert (ids, text, reason) == ([eos], "", "stop")


def test_naive_and_turbo_report_timings(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("mistral", "cpu")
    for mode in ("naive", "turbo"):
        chunks = synthetic_ids(engine, (12, 20), seed=51)
        result = generate(engine, engine.template.prompt(chunks, [5, 6]), SamplingParams(max_new_tokens=3), mode=mode)
        timings = result.timings
        assert timings.prefill_ms > 0 and timings.ttft_ms >= timings.prefill_ms
        assert (timings.stitch_ms > 0) == (mode == "turbo")


def test_deltas_through_the_rust_decoder_equal_the_tokenizers_own() -> None:
    """The detokenizer calls a fast tokenizer's Rust decoder directly (two decodes a token of every running answer
    on the engine thread): the text is the tokenizer's `decode`, special tokens skipped, for every prefix."""
    from service.engine.detokenize import rust_decoder

    tok = build_tokenizer()
    assert rust_decoder(tok) is not None
    ids = [*tok.encode(MULTIBYTE + " <|im_end|> end", add_special_tokens=False), tok.eos_token_id]
    fast, slow = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    slow._backend = None
    pairs = [(fast.push(i), slow.push(i)) for i in ids]
    assert [f for f, _ in pairs] == [s for _, s in pairs]
    assert fast.text == slow.text == tok.decode(ids, skip_special_tokens=True)
    for end in range(len(ids) + 1):
        assert rust_decoder(tok).decode(ids[:end], skip_special_tokens=True) == tok.decode(
            ids[:end], skip_special_tokens=True
        )


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_its_own_decode() -> None:
    """The clean-up of tokenization spaces (" ," -> ",") happens in transformers, not in the Rust decoder: a
    tokenizer that asks for it is not bypassed, except a BPE one, for which transformers skips it too."""
    from sentence_transformers import SentenceTransformer

    from service.engine.detokenize import rust_decoder
    from service.retrieval.embedder import bundled_model_path

    wordpiece = SentenceTransformer(str(bundled_model_path()), device="cpu").tokenizer
    wordpiece.clean_up_tokenization_spaces = True
    assert rust_decoder(wordpiece) is None
    detok = IncrementalDetokenizer(wordpiece)
    ids = wordpiece.encode("hello , world .", add_special_tokens=False)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == wordpiece.decode(ids, skip_special_tokens=True)

    bpe = build_tokenizer()
    bpe.clean_up_tokenization_spaces = True
    assert rust_decoder(bpe) is not None
