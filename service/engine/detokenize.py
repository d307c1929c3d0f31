"""Incremental detokenization: text deltas that never split a character, with stop strings held back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding a window that starts a few tokens back keeps tokenizers that depend on left context (leading
    spaces, byte fallback) right; a window that ends in U+FFFD is an unfinished UTF-8 sequence and waits.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._backend = rust_decoder(tokenizer)
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending = ""  # decoded text not yet emitted because it may begin a stop string
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=True))
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now safe to show (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(after[len(before) :])

    def flush(self) -> str:
        """Text still held back at the end of generation (a partial stop-string match)."""
        if self.stopped:
            return ""
        out, self._pending = self._pending, ""
        self.text += out
        return out

    def _release(self, delta: str) -> str:
        pending = self._pending + delta
        cut = _first_stop(pending, self._stop)
        if cut is not None:
            self.stopped = True
            out, self._pending = pending[:cut], ""
        else:
            hold = _longest_stop_prefix_suffix(pending, self._stop)
            out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self.text += out
        return out


def rust_decoder(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer a fast tokenizer's `decode` ends in, where calling it directly gives the same text: no
    clean-up of tokenization spaces applies (transformers skips it for BPE, where it would corrupt the text). Two
    decodes a token of every running answer run on the engine thread, and the Python layers around the Rust call
    (argument conversion, the clean-up checks) cost more than the call. None: decode through the tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return None
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if cleans_up and (type(backend.model).__name__ != "BPE" or forced):
        return None
    return backend


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best
