"""A conversation after the stitched chunks, as token ids through the model's chat template.

The prompt keeps its three parts: the template prefix, the chunk blocks (their KV reused), and one suffix that
is all that gets prefilled. With a conversation the suffix holds it: the conversation's first user message is
asked in the documents' turn, exactly where a lone question goes, and every other message (earlier answers,
later questions, system instructions) follows as its own chat-template turn, in order, the newest question
last. So a conversation of one question is a lone question's prompt, id for id.

The chat template is rendered once per sequence of roles around slot markers; the constant pieces between the
slots are encoded, each message's text is encoded alone, and the ids are joined, never the text (LMCache #194).
A template that cannot render the conversation (strict user/assistant alternation, no system turn after the
first) gets the messages as labelled lines inside the documents' turn instead, before its own assistant header.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedTokenizerBase

from service.engine.kv_layout import TokenIds
from service.engine.prompt import DOCS_SLOT, QUESTION_SLOT, PromptTemplate, encode, render_chat

Role = Literal["system", "user", "assistant"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant")
# Labels of the plain layout (no usable chat template); the answer cue closes it as the template's tail does.
PLAIN_LABELS: dict[str, str] = {"user": "\nQuestion: ", "assistant": "\nAnswer: ", "system": "\nInstruction: "}
# Role sequences whose rendered pieces are kept (each a few hundred ids at most).
PIECE_CACHE = 512


@dataclass(frozen=True)
class Turn:
    """One message of a conversation, its text already token ids."""

    role: Role
    ids: TokenIds


def _slot(index: int) -> str:
    return f"\u2060KVSTITCH_TURN_{index}\u2060"


class ConversationTemplate:
    """Builds the prefilled suffix of a prompt from a conversation (the new question last)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: PromptTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self._pieces = functools.lru_cache(maxsize=PIECE_CACHE)(self._render_pieces)

    def suffix(self, turns: Sequence[Turn]) -> TokenIds:
        """The suffix ids for `turns`, which end with the new question (a user turn)."""
        if not turns or turns[-1].role != "user":
            raise ValueError("a conversation ends with the new question, a user turn")
        first = next(i for i, t in enumerate(turns) if t.role == "user")
        if len(turns) == 1:
            return self.template.question_suffix(turns[0].ids)
        later = [*turns[:first], *turns[first + 1 :]]
        pieces = self._pieces(tuple(t.role for t in later))
        ids = [*pieces[0], *turns[first].ids]
        for piece, turn in zip(pieces[1:], later, strict=False):
            ids += [*piece, *turn.ids]
        ids += pieces[-1]
        return tuple(ids)

    def _render_pieces(self, roles: tuple[Role, ...]) -> tuple[TokenIds, ...]:
        """The constant ids around the first question and each later turn: len(roles) + 2 pieces."""
        for mapped in (roles, tuple("user" if r == "system" else r for r in roles)):
            pieces = self._chat_pieces(mapped)
            if pieces is not None:
                return pieces
        return self._plain_pieces(roles)

    def _chat_pieces(self, roles: tuple[str, ...]) -> tuple[TokenIds, ...] | None:
        slots = [_slot(i) for i in range(len(roles))]
        later = [{"role": role, "content": slot} for role, slot in zip(roles, slots, strict=True)]
        rendered = render_chat(self.tokenizer, later, slots)
        if rendered is None:
            return None
        head, rest = rendered.split(DOCS_SLOT, 1)
        if encode(self.tokenizer, head) != self.template.prefix:
            return None  # the prefix KV is shared by every request: a template that changes it cannot be used
        texts = []
        for slot in (QUESTION_SLOT, *slots):
            if slot not in rest:
                return None
            piece, rest = rest.split(slot, 1)
            texts.append(piece)
        return (*(encode(self.tokenizer, t) for t in texts), encode(self.tokenizer, rest))

    def _plain_pieces(self, roles: tuple[Role, ...]) -> tuple[TokenIds, ...]:
        labels = tuple(encode(self.tokenizer, PLAIN_LABELS[r]) for r in roles)
        return (self.template.question_head, *labels, self.template.question_tail)
