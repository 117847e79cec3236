"""Incremental detokenization: vLLM's prefix_offset / read_offset scheme, split across processes.

Why a window: byte-level BPE tokens can end in the middle of a UTF-8 character, and
SentencePiece-style tokenizers decide a leading space from the previous token. Decoding each
new token alone would garble both, so every step decodes a small window that starts a few
tokens before the new ones and keeps the text of the window's already-released prefix:

    full = decode(window); prev = decode(window[:prefix_len])
    if not final and full ends with U+FFFD: return ""   # half a character: wait for more
    return full[len(prev):]

(`decode_delta`). The engine keeps the offsets per sequence (`IncrementalDetokenizer`) and
ships `(window_ids, prefix_len)` with every response; postprocessing, which sees no history,
runs the same `decode_delta` on it and gets the same text. See docs/ARCHITECTURE.md.

Offsets, as indices into all_ids = prompt_ids + output_ids:
  read_offset   - everything before it has been released as text;
  prefix_offset - where the decoding window starts (the previous read_offset; initially up to
                  INITIAL_PREFIX_TOKENS before the end of the prompt, for context).
They advance only when a push releases text, so a push that ends in half a character (or only
in skipped special tokens) leaves them in place and the next window simply grows.

Tokenization-space cleanup is never applied: it rewrites text across token boundaries (" ." ->
"."), so decoded windows would not concatenate to the decoded whole.

Byte-fallback tokenizers (Llama 2, Mistral, Gemma: `<0xNN>` tokens and the ByteFallback decoder)
need one more rule. That decoder turns a run of byte tokens that is not valid UTF-8 as a whole
into one U+FFFD per byte, so a later stray byte garbles the valid characters before it in the
same run: decode is not prefix-stable, a merged window decodes to other text than its pushes
did, and a first window that starts inside a prompt character garbles the output's first
characters. `make_decoder` therefore decodes each byte that is not part of a well-formed
character as U+FFFD on its own (the tokens of U+FFFD's own bytes stand in for it), and keeps the
valid characters around it: the same text as the tokenizer's wherever the bytes are valid.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens of context for the first window.
INITIAL_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[list[int]], str]


def _as_int_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):  # numpy arrays / torch tensors from Triton tensors
        ids = ids.tolist()
    return [int(i) for i in ids]


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT_BYTES = (0xEF, 0xBF, 0xBD)  # U+FFFD in UTF-8


class _ByteFallback:
    """A ByteFallback tokenizer's byte tokens, and the ids its decode skips as special."""

    def __init__(self, byte_of: dict[int, int], special_ids: frozenset[int]) -> None:
        self.byte_of = byte_of
        id_of = {b: i for i, b in byte_of.items()}
        self.replacement = [id_of[b] for b in _REPLACEMENT_BYTES]
        self.special_ids = special_ids

    def well_formed(self, ids: list[int], skip_special_tokens: bool) -> list[int]:
        """`ids` with every byte token that is not part of a well-formed UTF-8 character (in its
        run of byte tokens) replaced by the three byte tokens of U+FFFD."""
        byte_of = self.byte_of
        if not any(t in byte_of for t in ids):
            return ids
        if skip_special_tokens:  # skipped tokens do not end a run: the decoder never sees them
            ids = [t for t in ids if t not in self.special_ids]
        out: list[int] = []
        i, n = 0, len(ids)
        while i < n:
            if ids[i] not in byte_of:
                out.append(ids[i])
                i += 1
                continue
            j = i
            while j < n and ids[j] in byte_of:
                j += 1
            run = [byte_of[t] for t in ids[i:j]]
            k = 0
            while k < len(run):
                width = _char_width(run, k)
                if width:
                    out.extend(ids[i + k : i + k + width])
                    k += width
                else:
                    out.extend(self.replacement)
                    k += 1
            i = j
        return out


def _char_width(data: list[int], at: int) -> int:
    """Bytes in the well-formed UTF-8 character starting at data[at]; 0 if none starts there
    (an invalid byte, or a character cut off by the end of the run). Unicode's table 3-7, as
    Python's and Rust's strict decoders apply it."""
    b = data[at]
    if b < 0x80:
        return 1
    if 0xC2 <= b <= 0xDF:
        width, lo, hi = 2, 0x80, 0xBF
    elif b == 0xE0:
        width, lo, hi = 3, 0xA0, 0xBF
    elif b == 0xED:
        width, lo, hi = 3, 0x80, 0x9F
    elif 0xE1 <= b <= 0xEF:
        width, lo, hi = 3, 0x80, 0xBF
    elif b == 0xF0:
        width, lo, hi = 4, 0x90, 0xBF
    elif 0xF1 <= b <= 0xF3:
        width, lo, hi = 4, 0x80, 0xBF
    elif b == 0xF4:
        width, lo, hi = 4, 0x80, 0x8F
    else:
        return 0
    if at + width > len(data) or not lo <= data[at + 1] <= hi:
        return 0
    if any(not 0x80 <= data[at + k] <= 0xBF for k in range(2, width)):
        return 0
    return width


_byte_fallback_cache: "weakref.WeakKeyDictionary[Any, Optional[_ByteFallback]]" = weakref.WeakKeyDictionary()


def _byte_fallback(tokenizer: Any, backend: Any) -> Optional[_ByteFallback]:
    """The tokenizer's byte tokens when its decoder has ByteFallback (looked up once)."""
    try:
        return _byte_fallback_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    found: Optional[_ByteFallback] = None
    decoder = backend.decoder
    if decoder is not None and b'"ByteFallback"' in decoder.__getstate__():
        byte_of = {}
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            m = _BYTE_TOKEN.fullmatch(token)
            if m:
                byte_of[i] = int(m.group(1), 16)
        if set(_REPLACEMENT_BYTES) <= set(byte_of.values()):
            special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
            found = _ByteFallback(byte_of, special)
    try:
        _byte_fallback_cache[tokenizer] = found
    except TypeError:
        pass
    return found


def make_decoder(tokenizer: Any, *, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> DecodeFn:
    """A `ids -> text` function equal to `tokenizer.decode(ids, ..., clean_up_tokenization_spaces=False)`,
    except that a byte-fallback tokenizer's invalid bytes are U+FFFD one by one (module doc).

    For fast (Rust `tokenizers`) tokenizers it calls the Rust decoder directly: transformers'
    decode adds Python overhead per call and, for fast tokenizers, ignores
    spaces_between_special_tokens anyway.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        rust_decode = backend.decode
        byte_fallback = _byte_fallback(tokenizer, backend)
        if byte_fallback is not None:
            well_formed = byte_fallback.well_formed

            def decode_byte_fallback(ids: list[int]) -> str:
                return rust_decode(well_formed(ids, skip_special_tokens), skip_special_tokens=skip_special_tokens)

            return decode_byte_fallback

        def decode(ids: list[int]) -> str:
            return rust_decode(ids, skip_special_tokens=skip_special_tokens)

        return decode

    def slow_decode(ids: list[int]) -> str:
        return tokenizer.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    return slow_decode


def _delta_or_held(decode: DecodeFn, ids: list[int], prefix_len: int, final: bool) -> tuple[str, Optional[str]]:
    """(the window's new text, None), or ("", the window's whole decode) when it ends in half a
    character and is held back."""
    if not 0 <= prefix_len <= len(ids):
        raise ValueError(f"prefix_len {prefix_len} outside the window of {len(ids)} tokens")
    if prefix_len == len(ids):
        return "", None
    full = decode(ids)
    if not final and full.endswith(REPLACEMENT_CHAR):
        return "", full
    prev = decode(ids[:prefix_len]) if prefix_len else ""
    return full[len(prev) :], None


def _delta(decode: DecodeFn, ids: list[int], prefix_len: int, final: bool) -> str:
    return _delta_or_held(decode, ids, prefix_len, final)[0]


def decode_delta(
    tokenizer: Any,
    ids: Sequence[int],
    prefix_len: int,
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    final: bool = False,
) -> str:
    """New text of a detokenization window: decode(ids) minus decode(ids[:prefix_len]).

    Returns "" while the window ends in an incomplete UTF-8 character, unless `final`.
    `ids` may be a list or an array (a Triton tensor).
    """
    decode = make_decoder(
        tokenizer, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
    )
    return _delta(decode, _as_int_list(ids), int(prefix_len), final)


class DetokDelta(NamedTuple):
    """What one push released, and the window that reproduces it with `decode_delta`.

    window_ids = all_ids[window_start:] (to the end, as of the push) and
    prefix_len = read_offset - prefix_offset, both taken *before* the push; so
    decode_delta(window_ids, prefix_len, final=False) == text.

    Merging consecutive pushes p..q into one non-final response: the window is
    all_ids[p.window_start : q.read_offset] with prefix_len p.prefix_len (not ending at q's
    last token: if q held back half a character, a window ending there decodes to "").
    """

    text: str
    window_ids: list[int]
    prefix_len: int
    window_start: int  # index of window_ids[0] in all_ids (= prefix_offset before the push)
    read_offset: int  # read_offset after the push: everything before it is released text


@dataclass(frozen=True)
class DetokMark:
    """Detokenizer state at a point in time; see IncrementalDetokenizer.window_since."""

    prefix_offset: int
    read_offset: int


class IncrementalDetokenizer:
    """One sequence's detokenization state (engine side).

    Aggregating several pushes into one response (non-streaming output, held-back steps):

        m = detok.mark()                 # before the first push of the response
        ... detok.push(ids) ...          # one or more pushes (and finish() at the end)
        ids, prefix_len = detok.window_since(m, final=finished)
        decode_delta(tok, ids, prefix_len, final=finished) == "".join(texts of those pushes)
                                                             (+ finish()'s text when final)

    A non-final aggregated window ends at read_offset, not at the last token: a trailing
    push that held back half a character would make the whole aggregated window decode to
    "" (it would end in U+FFFD). Those held-back tokens start the next window instead.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode = make_decoder(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        self.all_ids: list[int] = _as_int_list(prompt_ids)
        self.num_prompt_tokens = len(self.all_ids)
        self.read_offset = self.num_prompt_tokens
        self.prefix_offset = max(self.read_offset - INITIAL_PREFIX_TOKENS, 0)
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._held_decode: Optional[str] = None  # the window's decode while it is held back

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[self.num_prompt_tokens :]

    @property
    def text(self) -> str:
        """All output text released so far (by push and finish)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    def _advance(self, final: bool) -> tuple[str, list[int], int, int]:
        start, prefix_len = self.prefix_offset, self.read_offset - self.prefix_offset
        window = self.all_ids[start:]
        text, self._held_decode = _delta_or_held(self._decode, window, prefix_len, final)
        if text:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.all_ids)
            self._chunks.append(text)
            self._text_cache = None
        return text, window, prefix_len, start

    def push(self, new_ids: Sequence[int]) -> DetokDelta:
        """Append one step's tokens; returns the text they complete (may be "")."""
        self.all_ids.extend(_as_int_list(new_ids))
        text, window, prefix_len, start = self._advance(final=False)
        return DetokDelta(text, window, prefix_len, start, self.read_offset)

    def held_text(self) -> str:
        """The text the last push held back for half a character, as finish() would flush it
        (U+FFFD for the half character): "" when that push released text or added none. Stop
        strings are searched in it at once, as SGLang decodes a stop check's tail (U+FFFD and
        all), so a stop ends the output on the token that writes it, not on the one after."""
        if self._held_decode is None:
            return ""
        released = self.read_offset - self.prefix_offset
        prev = self._decode(self.all_ids[self.prefix_offset : self.read_offset]) if released else ""
        return self._held_decode[len(prev) :]

    def finish(self) -> str:
        """Flush text held back for an incomplete character (as U+FFFD); call at the end."""
        return self._advance(final=True)[0]

    def mark(self) -> DetokMark:
        return DetokMark(self.prefix_offset, self.read_offset)

    def window_since(self, mark: DetokMark, final: bool = False) -> tuple[list[int], int]:
        """(window_ids, prefix_len) whose decode_delta is all text released since `mark`.

        `final=True` (after finish()) extends the window to the last token.
        """
        end = len(self.all_ids) if final else self.read_offset
        return self.all_ids[mark.prefix_offset : end], mark.read_offset - mark.prefix_offset
