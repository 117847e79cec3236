"""backend/ensemble_check.py: an llm whose ensemble tokenizes with another model's tokenizer is
refused at load (QA: llm's model_path edited alone served garbage with nothing in any log); one
that loads the same tokenizer from other files is not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backend.ensemble_check import TOKENIZER_FILES, check_ensemble_tokenizers, ensemble_tokenizer_paths

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = ("ensemble", "preprocessing", "llm", "postprocessing")


def _tokenizer_copy(demo: Path, to: Path, change: bool = False) -> Path:
    to.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (demo / name).exists():
            shutil.copy2(demo / name, to / name)
    if change:  # another tokenizer: one more added token
        cfg = json.loads((to / "tokenizer_config.json").read_text())
        cfg["added_tokens_decoder"]["4095"] = {"content": "<extra>", "lstrip": False, "normalized": False,
                                               "rstrip": False, "single_word": False, "special": True}
        (to / "tokenizer_config.json").write_text(json.dumps(cfg))
    return to


def _repository(tmp_path: Path, paths: dict[str, str]) -> Path:
    """model_repository/'s configs, each model_path replaced by paths[model] where given."""
    repo = tmp_path / "repository"
    for model in MODELS:
        text = (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text()
        if model in paths:
            old = '{ key: "model_path", value: { string_value: "models/demo" } }'
            assert old in text
            text = text.replace(old, f'{{ key: "model_path", value: {{ string_value: "{paths[model]}" }} }}')
        (repo / model).mkdir(parents=True)
        (repo / model / "config.pbtxt").write_text(text)
    return repo


def _args(repo: Path, model_path: str, name: str = "llm") -> dict:
    config = {"parameters": {"model_path": {"string_value": model_path}}}
    return {"model_name": name, "model_repository": str(repo / name), "model_config": json.dumps(config)}


def test_the_shipped_repository_agrees():
    assert ensemble_tokenizer_paths(REPO_ROOT / "model_repository", "llm") == [
        ("ensemble", "preprocessing", "models/demo"), ("ensemble", "postprocessing", "models/demo")]
    check_ensemble_tokenizers(_args(REPO_ROOT / "model_repository", "models/demo"), env={})


def test_llm_pointed_at_another_tokenizer_alone_is_refused_naming_each_step(tmp_path, demo_model_path):
    other = _tokenizer_copy(demo_model_path, tmp_path / "other", change=True)
    repo = _repository(tmp_path, {"llm": str(other)})
    with pytest.raises(ValueError) as err:
        check_ensemble_tokenizers(_args(repo, str(other)), env={})
    demo = REPO_ROOT / "models" / "demo"
    assert str(err.value).startswith(
        f"llm serves {other}, but preprocessing (a step of ensemble) loads its tokenizer from {demo}; "
        f"postprocessing (a step of ensemble) loads its tokenizer from {demo}: a different tokenizer")
    assert "LLM_MODEL_PATH (scripts/serve.sh --model-path)" in str(err.value)
    # Only postprocessing left behind: only it is named.
    repo = _repository(tmp_path / "2", {"llm": str(other), "preprocessing": str(other)})
    with pytest.raises(ValueError, match=r"^llm serves .*, but postprocessing \(a step of ensemble\) loads [^;]*: a"):
        check_ensemble_tokenizers(_args(repo, str(other)), env={})


def test_a_byte_equal_tokenizer_elsewhere_agrees_and_the_environment_overrides_all(tmp_path, demo_model_path):
    copy = _tokenizer_copy(demo_model_path, tmp_path / "tokenizer_only")
    repo = _repository(tmp_path, {"preprocessing": str(copy), "postprocessing": str(copy)})
    check_ensemble_tokenizers(_args(repo, "models/demo"), env={})
    # A relative model_path is the repository root's, as every model resolves it; empty is the default.
    repo = _repository(tmp_path / "2", {"preprocessing": "models/demo", "postprocessing": ""})
    check_ensemble_tokenizers(_args(repo, ""), env={})
    other = _tokenizer_copy(demo_model_path, tmp_path / "other", change=True)
    repo = _repository(tmp_path / "3", {"llm": str(other)})
    check_ensemble_tokenizers(_args(repo, str(other)), env={"LLM_MODEL_PATH": str(other)})  # all load it
    with pytest.raises(ValueError):
        check_ensemble_tokenizers(_args(repo, str(other)), env={})


def test_a_tokenizer_saved_elsewhere_agrees_though_its_files_differ_and_a_directory_without_one_does_not(
        tmp_path, demo_model_path):
    from backend.ensemble_check import same_tokenizer
    from backend.tokenizer import load_tokenizer

    saved = tmp_path / "saved"  # TensorRT-LLM's tokenizer_dir is made so: other files, other bytes
    load_tokenizer(demo_model_path).save_pretrained(saved)
    assert (saved / "tokenizer_config.json").read_bytes() != (demo_model_path / "tokenizer_config.json").read_bytes()
    assert same_tokenizer(demo_model_path, saved)
    repo = _repository(tmp_path, {"preprocessing": str(saved), "postprocessing": str(saved)})
    check_ensemble_tokenizers(_args(repo, str(demo_model_path)), env={})
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not same_tokenizer(demo_model_path, empty)
    assert not same_tokenizer(demo_model_path, _tokenizer_copy(demo_model_path, tmp_path / "other", change=True))


def test_only_ensembles_naming_the_model_are_read_and_unreadable_configs_are_skipped(tmp_path, demo_model_path):
    other = _tokenizer_copy(demo_model_path, tmp_path / "other", change=True)
    repo = _repository(tmp_path, {"llm": str(other)})
    (repo / "broken").mkdir()
    (repo / "broken" / "config.pbtxt").write_text("name: 'broken' platform: {")
    # Renamed: the ensemble still names "llm", so an llm served under another name has no ensemble here.
    check_ensemble_tokenizers(_args(repo, str(other), name="llm_b"), env={})
    # A model without a name in its config takes its directory's, as in Triton.
    text = (repo / "ensemble" / "config.pbtxt").read_text().replace('name: "ensemble"', "")
    assert 'name: "ensemble"' not in text
    (repo / "ensemble" / "config.pbtxt").write_text(text)
    assert [e for e, _, _ in ensemble_tokenizer_paths(repo, "llm")] == ["ensemble", "ensemble"]
