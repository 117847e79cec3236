"""Optional local model files: token texts (for logprobs, echo of token prompts) and model info.

The frontend never needs the tokenizer to serve text (Triton's preprocessing/postprocessing own
tokenization); `--tokenizer-path` only adds token strings, the end-of-sequence ids beam search
needs, and the model's context length until the engine reports its own. Loaded lazily with
the `tokenizers` library (no transformers import).
"""

from __future__ import annotations

import json
import logging
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

    def eos_token_ids(self) -> Optional[frozenset[int]]:
        """The ids that end a generation (generation_config.json's `eos_token_id`, else
        config.json's; an int or a list), or None without model files."""
        if self.path is None:
            return None
        for name in ("generation_config.json", "config.json"):
            try:
                value = json.loads((self.path / name).read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                continue
            ids = [value] if isinstance(value, int) else value if isinstance(value, list) else []
            if ids and all(isinstance(i, int) for i in ids):
                return frozenset(ids)
        return None

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

    def decode(self, ids: list[int]) -> Optional[str]:
        tok = self.tokenizer()
        return None if tok is None else tok.decode(ids, skip_special_tokens=False)


@lru_cache(maxsize=65536)
def _token_text(files: ModelFiles, token_id: int) -> str:
    tok = files.tokenizer()
    if tok is None:
        return f"token_id:{token_id}"
    return tok.decode([token_id], skip_special_tokens=False)
