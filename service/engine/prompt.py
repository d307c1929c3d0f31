"""The prompt as token ids: prefix block + one block per chunk + question suffix.

Every piece is tokenized on its own and joined as ids, never as text, so the block cached for a chunk and the
naive baseline see exactly the same ids, and no separator can merge with its neighbour (LMCache #194, #195).
The wording follows TurboRAG appendix C.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from service.engine.kv_layout import TokenIds

TEMPLATE_VERSION = "turborag-c/1"
SYSTEM_TEXT = (
    "You are an accurate and reliable AI assistant capable of answering questions by referencing external "
    "documents. Please note that the external documents may not always be related to the question."
)
DOCS_INTRO = "The documents are as follows:\n"
DOCS_OUTRO = (
    "\nIf the information in the documents contain the correct answer, you will provide an accurate response. "
    "If the documents do not contain the answer, you will refuse to answer.\n\nQuestion: "
)
DOC_OPEN = "<|doc_start|>"
DOC_CLOSE = "<|doc_end|>\n"
PLAIN_ANSWER_CUE = "\nAnswer:"
DOCS_SLOT = "\u2060KVSTITCH_DOCS\u2060"
QUESTION_SLOT = "\u2060KVSTITCH_QUESTION\u2060"


@dataclass(frozen=True)
class PromptIds:
    """One request's prompt, still in its parts. `block_hashes`: each block's hash, computed with the prompt (on the
    thread that builds it): the engine thread looks chunks up by them at every admission, where hashing thousands
    of ids a request was a visible share of its time."""

    prefix: TokenIds
    blocks: tuple[TokenIds, ...]
    question: TokenIds
    block_hashes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", tuple(hash(tuple(block)) for block in self.blocks))

    def joined(self) -> list[int]:
        """The full id sequence (the naive baseline's input)."""
        ids = list(self.prefix)
        for block in self.blocks:
            ids.extend(block)
        ids.extend(self.question)
        return ids

    @property
    def context_tokens(self) -> int:
        return len(self.prefix) + sum(len(b) for b in self.blocks)

    @property
    def total_tokens(self) -> int:
        """len(joined()), without joining: counted at every admission, where building the list is ~8K ids."""
        return self.context_tokens + len(self.question)


@dataclass(frozen=True)
class PromptTemplate:
    """Constant id pieces of the template, computed once per model and template."""

    prefix: TokenIds
    doc_open: TokenIds
    doc_close: TokenIds
    question_head: TokenIds
    question_tail: TokenIds
    version: str

    def chunk_block(self, chunk_ids: Sequence[int]) -> TokenIds:
        """The cached block of a chunk: wrapper + chunk ids, no BOS."""
        if not chunk_ids:
            raise ValueError("a chunk block needs at least one token")
        # This runs on the event loop for every chunk of every question (thousands of ids each), where converting
        # each id was a visible share of its time: a tuple (`TokenIds`, as retrieval and the engine's API decode
        # them) is joined as it is, anything else converted id by id.
        ids = chunk_ids if type(chunk_ids) is tuple else tuple(map(int, chunk_ids))
        return self.doc_open + ids + self.doc_close

    def question_suffix(self, question_ids: Sequence[int]) -> TokenIds:
        """Instruction tail + question + end of the user turn and the assistant header."""
        if not question_ids:
            raise ValueError("the question needs at least one token")
        return (*self.question_head, *(int(t) for t in question_ids), *self.question_tail)

    def prompt(self, chunk_ids: Sequence[Sequence[int]], question_ids: Sequence[int]) -> PromptIds:
        blocks = tuple(self.chunk_block(c) for c in chunk_ids)
        return PromptIds(self.prefix, blocks, self.question_suffix(question_ids))


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> TokenIds:
    """Token ids of a piece of the template, without any special tokens added around it: a special token's string
    in it becomes its control id. Only for the template's own text; a client's or a document's goes through
    `encode_text`."""
    return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class _TextCodec:
    backend: Tokenizer | None  # None for a tokenizer without a Rust backend
    special: frozenset[int]


# Keyed weakly: an engine's tokenizer lives as long as the engine, and tests build many.
_TEXT_CODECS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, _TextCodec] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every special/control id: the named specials and each added token flagged special (`<|im_start|>`,
    `<|eot_id|>`, `[INST]`, ...), which `all_special_ids` alone does not list. Not the unknown token: a tokenizer
    without byte fallback gives it for text it has no token for (WordPiece), and it controls nothing."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    ids = {int(i) for i in tokenizer.all_special_ids} | {int(i) for i, t in added.items() if t.special}
    return frozenset(ids - {tokenizer.unk_token_id})


def _text_codec(tokenizer: PreTrainedTokenizerBase) -> _TextCodec:
    codec = _TEXT_CODECS.get(tokenizer)
    if codec is None:
        backend = None
        if getattr(tokenizer, "is_fast", False):
            # A copy of the Rust tokenizer with `encode_special_tokens` on for good. The flag is state of the
            # tokenizer object, not an argument of one call: setting it on the shared one per call
            # (`split_special_tokens=True`) would race the ingest worker, the request threads and the template
            # pieces, and a text could be encoded between another thread's set and its own.
            backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
            backend.no_truncation()  # the saved state carries whatever padding/truncation the last call set
            backend.no_padding()
            backend.encode_special_tokens = True
        codec = _TEXT_CODECS[tokenizer] = _TextCodec(backend, special_ids(tokenizer))
    return codec


def text_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """The Rust tokenizer `encode_text` uses (for offsets and counts of the same ids); fast tokenizers only."""
    backend = _text_codec(tokenizer).backend
    if backend is None:
        raise ValueError("a fast (Rust-backed) tokenizer is needed here")
    return backend


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> TokenIds:
    """Token ids of a client's or a document's text (question, history, message content, chunk): a special
    token's string written in it (`<|im_start|>`, `<|eot_id|>`, `</s>`) is encoded as the characters it is, never
    as its control id, so a text cannot forge a chat turn; only the template inserts control tokens. Text without
    such strings gets `encode`'s ids, id for id (the chunks' KV cache keys are their ids)."""
    codec = _text_codec(tokenizer)
    if codec.backend is not None:
        ids: Sequence[int] = codec.backend.encode(text, add_special_tokens=False).ids
    else:  # the Python tokenizers split per call, with no shared state
        ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    if not codec.special.isdisjoint(ids):
        # Not reached with the tokenizers above; kept because a forged turn must fail loudly, not reach the model.
        raise ValueError("the text encoded to a special token id")
    return tuple(int(t) for t in ids)


def system_text(extra: str = "") -> str:
    """The system message: SYSTEM_TEXT, then `extra` (an eval's answer-style instruction) when given."""
    return f"{SYSTEM_TEXT} {extra.strip()}" if extra.strip() else SYSTEM_TEXT


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    later: Sequence[dict[str, str]] = (),
    slots: Sequence[str] = (),
    system_extra: str = "",
) -> str | None:
    """The chat template rendered around the documents' and the question's slots (and `later` turns after the
    documents' turn, whose `slots` must all appear), or None when the tokenizer has no template that does so."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    user = DOCS_INTRO + DOCS_SLOT + DOCS_OUTRO + QUESTION_SLOT
    system = system_text(system_extra)
    attempts: list[list[dict[str, str]]] = [
        [{"role": "system", "content": system}, {"role": "user", "content": user}, *later],
        # templates that refuse a system turn
        [{"role": "user", "content": system + "\n\n" + user}, *later],
    ]
    for messages in attempts:
        try:
            rendered: Any = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # jinja templates raise arbitrary errors for roles they do not support
            continue
        if isinstance(rendered, str) and all(s in rendered for s in (DOCS_SLOT, QUESTION_SLOT, *slots)):
            return rendered
    return None


def _bos(tokenizer: PreTrainedTokenizerBase) -> TokenIds:
    bos = tokenizer.bos_token_id
    return () if bos is None else (int(bos),)


def build_template(tokenizer: PreTrainedTokenizerBase, system_extra: str = "") -> PromptTemplate:
    """Split the model's chat template (or a plain fallback) into constant id pieces. `system_extra` is appended
    to the system message (the eval's short-answer instruction); the server's template has none."""
    rendered = render_chat(tokenizer, system_extra=system_extra)
    if rendered is not None:
        head, rest = rendered.split(DOCS_SLOT, 1)
        middle, tail = rest.split(QUESTION_SLOT, 1)
        prefix = encode(tokenizer, head)
        question_head, question_tail = encode(tokenizer, middle), encode(tokenizer, tail)
    else:
        prefix = _bos(tokenizer) + encode(tokenizer, system_text(system_extra) + "\n\n" + DOCS_INTRO)
        question_head, question_tail = encode(tokenizer, DOCS_OUTRO), encode(tokenizer, PLAIN_ANSWER_CUE)
    doc_open, doc_close = encode(tokenizer, DOC_OPEN), encode(tokenizer, DOC_CLOSE)
    pieces = [TEMPLATE_VERSION, prefix, doc_open, doc_close, question_head, question_tail]
    digest = hashlib.sha256(json.dumps(pieces).encode()).hexdigest()[:16]
    return PromptTemplate(
        prefix=prefix,
        doc_open=doc_open,
        doc_close=doc_close,
        question_head=question_head,
        question_tail=question_tail,
        version=f"{TEMPLATE_VERSION}:{digest}",
    )
