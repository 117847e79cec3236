"""Optional local model files: token texts (for logprobs, echo of token prompts) and model info.

The frontend never needs the tokenizer to serve text (Triton's preprocessing/postprocessing own
tokenization); `--tokenizer-path` only adds token strings, and the model's context length until
the engine reports its own. Loaded lazily with the `tokenizers` library (no transformers import).
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)


class ModelFiles:
    def __init__(self, path: Optional[str]) -> None:
        self.path = Path(path) if path else None
        self._tokenizer: Any = None
        self._loaded = False

    @property
    def max_model_len(self) -> Optional[int]:
        if self.path is None:
            return None
        try:
            cfg = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        value = cfg.get("max_position_embeddings")
        return int(value) if isinstance(value, int) else None

    def tokenizer(self) -> Any:
        if not self._loaded:
            self._loaded = True
            if self.path is not None and (self.path / "tokenizer.json").exists():
                try:
                    from tokenizers import Tokenizer

                    self._tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
                except Exception as exc:  # a broken tokenizer must not take the server down
                    log.warning("could not load %s/tokenizer.json: %s", self.path, exc)
        return self._tokenizer

    def token_text(self, token_id: int) -> str:
        return _token_text(self, token_id)

    def token_bytes(self, token_id: int) -> Optional[bytes]:
        """The token's own bytes, where the tokenizer says them: a byte-level BPE piece (GPT-2's
        byte-to-character table, Qwen and Llama 3) or a byte-fallback piece (`<0xE8>`, Llama 2
        and Mistral). A piece that is part of a character decodes to U+FFFD as text; its bytes
        are what lets a client join the pieces into the character (OpenAI's `bytes`). None when
        the tokenizer does not say."""
        return _token_bytes(self, token_id)

    def is_special(self, token_id: int) -> bool:
        """Whether the token is a special one (skip_special_tokens leaves it out of the text)."""
        return _is_special(self, token_id)

    def byte_level(self) -> bool:
        """Whether the tokenizer's decoder is GPT-2-style byte-level."""
        if self.path is None:
            return False
        try:
            decoder = json.loads((self.path / "tokenizer.json").read_text()).get("decoder") or {}
        except (OSError, ValueError):
            return False
        kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
        return "ByteLevel" in kinds

    def decode(self, ids: list[int]) -> Optional[str]:
        tok = self.tokenizer()
        return None if tok is None else tok.decode(ids, skip_special_tokens=False)


@lru_cache(maxsize=65536)
def _token_text(files: ModelFiles, token_id: int) -> str:
    tok = files.tokenizer()
    if tok is None:
        return f"token_id:{token_id}"
    return tok.decode([token_id], skip_special_tokens=False)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level BPE piece uses -> its byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=65536)
def _token_bytes(files: ModelFiles, token_id: int) -> Optional[bytes]:
    tok = files.tokenizer()
    piece = tok.id_to_token(token_id) if tok is not None else None
    if piece is None:
        return None
    if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
        return bytes([int(m.group(1), 16)])
    if _is_added(tok, token_id):
        return piece.encode("utf-8")  # special and added tokens are their own text
    if _byte_level(files):
        try:
            return bytes(_BYTE_DECODER[c] for c in piece)
        except KeyError:
            return None
    return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker


@lru_cache(maxsize=8)
def _byte_level(files: ModelFiles) -> bool:
    return files.byte_level()


@lru_cache(maxsize=65536)
def _is_special(files: ModelFiles, token_id: int) -> bool:
    tok = files.tokenizer()
    try:
        added = tok.get_added_tokens_decoder().get(token_id) if tok is not None else None
    except AttributeError:
        return False
    return bool(added is not None and added.special)


def _is_added(tok: Any, token_id: int) -> bool:
    try:
        return token_id in tok.get_added_tokens_decoder()
    except AttributeError:
        return False
