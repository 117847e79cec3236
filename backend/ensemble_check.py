"""At load: the ensembles that run this `llm` tokenize and detokenize with its tokenizer.

Each Python model of the chain has a `model_path` of its own in its config.pbtxt. Pointing llm's
at another model and leaving preprocessing's (or postprocessing's) at the demo model loads fine,
then feeds the model another tokenizer's ids and decodes its ids with that tokenizer: output that
looks like a broken model, with nothing in any log. `LLM_MODEL_PATH` (`scripts/serve.sh
--model-path`) sets all three at once; editing the files one by one does not.

Only what can be read is compared: the ensembles in this model's own repository directory that
name it as a step, and those steps' `model_path` parameters. Another directory agrees when its
tokenizer files are byte-equal, or when the tokenizer it loads is this one: the same vocabulary
(added tokens included), special tokens and ids for a probe text. So a tokenizer-only copy (as
TensorRT-LLM's `tokenizer_dir`), written by `save_pretrained` or trimmed of files, is accepted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from backend.tokenizer import load_tokenizer
from backend.triton_utils import DEFAULT_MODEL_PATH, MODEL_PATH_ENV, model_path_from_config, resolve_path

# What AutoTokenizer reads: these decide the ids of a text and the text of ids.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")


def _configs(repository: Path) -> Iterator[object]:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    for file in sorted(repository.glob("*/config.pbtxt")):
        try:
            config = text_format.Parse(file.read_text(), model_config_pb2.ModelConfig())
        except Exception:  # Triton reports its own parse errors; nothing to compare here
            continue
        if not config.name:
            config.name = file.parent.name  # as Triton names a model without one
        yield config


def ensemble_tokenizer_paths(repository: Path, model: str) -> list[tuple[str, str, str]]:
    """(ensemble, step model, its raw `model_path`) for the other steps of every ensemble in
    `repository` that has `model` as a step, where that step's config sets a `model_path`."""
    configs = {c.name: c for c in _configs(repository)}
    found = []
    for name, config in configs.items():
        steps = [s.model_name for s in config.ensemble_scheduling.step]
        if model not in steps:
            continue
        for step in dict.fromkeys(steps):
            other = configs.get(step)
            if step == model or other is None or "model_path" not in other.parameters:
                continue
            found.append((name, step, other.parameters["model_path"].string_value))
    return found


# Text whose ids tell tokenizers apart: spaces and newlines, digits, code, CJK, emoji, accents.
_PROBE = "Hello, world!  It's 2026-11-29: café, naïve, 東京 and 🚀.\n\tdef f(x): return x**2  # done"


def _same_files(a: Path, b: Path) -> bool:
    for name in TOKENIZER_FILES:
        fa, fb = a / name, b / name
        if fa.exists() != fb.exists() or (fa.exists() and fa.read_bytes() != fb.read_bytes()):
            return False
    return True


def _fingerprint(tokenizer: Any) -> tuple:
    return (sorted(tokenizer.get_vocab().items()), sorted(tokenizer.all_special_ids),
            tokenizer.encode(_PROBE), tokenizer.encode(_PROBE, add_special_tokens=False))


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether directories a and b load the same tokenizer (b's failing to load: not the same)."""
    if a.resolve() == b.resolve() or _same_files(a, b):
        return True
    try:
        return _fingerprint(load_tokenizer(a)) == _fingerprint(load_tokenizer(b))
    except Exception:  # noqa: BLE001 -- b holds no tokenizer that loads: that step would not serve this model
        return False


def check_ensemble_tokenizers(args: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> None:
    """From a model's initialize(args): raises ValueError naming each step of its ensembles
    whose tokenizer is not its own. With LLM_MODEL_PATH set every model loads that directory, and
    there is nothing to check."""
    env = os.environ if env is None else env
    if env.get(MODEL_PATH_ENV):
        return
    model, own = args["model_name"], model_path_from_config(args, env)
    mismatched, same = [], {}  # one comparison a directory, however many steps load from it
    for ensemble, step, raw in ensemble_tokenizer_paths(Path(args["model_repository"]).parent, model):
        path = resolve_path(raw or DEFAULT_MODEL_PATH)  # what that model's model_path_from_config loads
        if path not in same:
            same[path] = same_tokenizer(path, own)
        if not same[path]:
            mismatched.append(f"{step} (a step of {ensemble}) loads its tokenizer from {path}")
    if mismatched:
        raise ValueError(
            f"{model} serves {own}, but {'; '.join(mismatched)}: a different tokenizer would feed the model "
            "ids it was not trained on and decode its ids into other text. Set the same model_path in the "
            "config.pbtxt of every model of the ensemble, or set LLM_MODEL_PATH (scripts/serve.sh --model-path), "
            "which sets all of them"
        )
