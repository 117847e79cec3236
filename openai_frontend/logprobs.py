"""Engine logprobs -> OpenAI `logprobs` objects (chat and completions formats).

The engine reports logprobs in each chunk's meta_info (see EngineChunk.logprobs). When a request
asked for logprobs and the engine sent none, the choice's logprobs is null.
"""

from __future__ import annotations

import codecs
from typing import Any, Optional

from openai_frontend.engine_types import TokenLogprob
from openai_frontend.tokenizer import ModelFiles


class TokenNamer:
    def __init__(self, files: Optional[ModelFiles], as_token_ids: bool = False) -> None:
        self.files = files
        self.as_token_ids = as_token_ids

    def __call__(self, lp: TokenLogprob) -> str:
        if self.as_token_ids:
            return f"token_id:{lp.token_id}"
        if lp.text is not None:
            return lp.text
        if self.files is not None:
            return self.files.token_text(lp.token_id)
        return f"token_id:{lp.token_id}"

    def raw(self, lp: TokenLogprob) -> Optional[bytes]:
        """The token's own bytes where the tokenizer says them, else None."""
        return self.files.token_bytes(lp.token_id) if self.files is not None else None

    def special(self, lp: TokenLogprob) -> bool:
        return self.files is not None and self.files.is_special(lp.token_id)

    def bytes(self, lp: TokenLogprob, token: str) -> list[int]:
        """OpenAI's `bytes` of a token: its own bytes where the tokenizer says them (a piece of a
        character is U+FFFD as text, and its bytes are what joins it back), else its text's."""
        raw = self.raw(lp)
        return list(raw if raw is not None else token.encode("utf-8"))


def chat_logprobs(items: list[TokenLogprob], name: TokenNamer) -> dict[str, Any]:
    content = []
    for lp in items:
        token = name(lp)
        content.append({
            "token": token,
            "logprob": lp.logprob,
            "bytes": name.bytes(lp, token),
            "top_logprobs": [
                {"token": (t := name(top)), "logprob": top.logprob, "bytes": name.bytes(top, t)} for top in lp.top
            ],
        })
    return {"content": content}


def prompt_logprobs(items: list[TokenLogprob], name: TokenNamer) -> list[Optional[dict[str, Any]]]:
    """vLLM's `prompt_logprobs`: per prompt token (the first is null), its own logprob and the top
    alternatives', keyed by token id, each with its rank and decoded text."""
    out: list[Optional[dict[str, Any]]] = []
    for lp in items:
        if lp.logprob is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": name(lp)}}
        for rank, t in enumerate(lp.top, 1):
            entry.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": name(t)})
        out.append(entry)
    return out


class CompletionLogprobs:
    """Accumulates the legacy completions logprobs format across chunks.

    `text_offset` indexes the choice's `text`. Each chunk's text is what its tokens added, so a
    chunk's first token starts where the text stood before it, and the tokens within a chunk
    advance by the characters they complete: a token's bytes through a UTF-8 decoder, so the
    first pieces of a character add none and its last piece adds it (a token's name alone, "�"
    for each piece, drifted one place per piece: CJK text's offsets pointed past its tokens), and
    a special token the text skips adds none. vLLM advances by the length of each token's name."""

    def __init__(self, name: TokenNamer, skip_special_tokens: bool = True) -> None:
        self.name = name
        self.skip_special_tokens = skip_special_tokens
        self.offset = 0  # the text's length so far
        # Characters counted for tokens whose text a chunk did not carry yet (the detokenizer held
        # back a piece that may still join the next token's bytes, or a possible stop string's
        # start): the next chunks' text starts with them. QA: the next chunk's first token's
        # offset pointed at them, unlike non-streaming.
        self._owed = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.tokens: list[str] = []
        self.token_logprobs: list[Optional[float]] = []  # None: the echoed prompt's first token
        self.top_logprobs: list[Optional[dict[str, float]]] = []
        self.text_offset: list[int] = []

    def add(self, items: list[TokenLogprob], text: str, whole: bool = False) -> None:
        """Add a chunk's tokens and the text they added (an echoed prompt is a chunk of its own).
        `whole`: the text is all these tokens will ever have (a sample's last chunk, whose stop
        string may be trimmed; the echoed prompt, as given though its tokens may decode longer):
        offsets stay within it and nothing is owed to the next chunk."""
        base, done = self.offset, self._owed
        for lp in items:
            token = self.name(lp)
            self.tokens.append(token)
            self.token_logprobs.append(lp.logprob)
            # OpenAI's legacy format: the `logprobs` most likely tokens "as well as the chosen
            # token", the chosen one first (vLLM's order); none for a prompt's first token.
            if lp.logprob is None:
                self.top_logprobs.append(None)
            else:
                top = {token: lp.logprob}
                for t in lp.top:
                    top.setdefault(self.name(t), t.logprob)
                self.top_logprobs.append(top)
            # A stop string trimmed from the last chunk's text leaves tokens with less text than
            # their bytes; text held back comes with the next chunks.
            self.text_offset.append(base + (min(done, len(text)) if whole else done))
            done += self._chars(lp, token)
        self.offset = base + len(text)
        self._owed = 0 if whole else max(done - len(text), 0)

    def _chars(self, lp: TokenLogprob, token: str) -> int:
        if self.skip_special_tokens and self.name.special(lp):
            return 0
        raw = self.name.raw(lp)
        if raw is None:
            return len(token)
        return len(self._utf8.decode(raw))

    def since(self, start: int) -> dict[str, Any]:
        """The logprobs object of the tokens from `start` on (a streamed chunk's own)."""
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def result(self) -> dict[str, Any]:
        return self.since(0)
