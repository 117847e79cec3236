"""The frontend's LoRA adapter names against a scripted engine client (FakeLLMClient, whose
`adapters` stand for the engine's loaded adapters): the base model's names stay the base
model's, and what /v1/models lists is what requests may name."""

from __future__ import annotations

import httpx
import pytest

from openai_frontend.__main__ import main
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import FakeLLMClient, serve_in_thread, text_chunks

LOAD_PATHS = ("/load_lora_adapter", "/v1/load_lora_adapter")
UNLOAD_PATHS = ("/unload_lora_adapter", "/v1/unload_lora_adapter")


def _fake(adapters: dict[str, str]) -> FakeLLMClient:
    fake = FakeLLMClient(lambda req: text_chunks(["a"]))
    fake.adapters = dict(adapters)
    return fake


def _models(url: str) -> list[tuple[str, object]]:
    return [(m["id"], m["parent"]) for m in httpx.get(url + "/v1/models").json()["data"]]


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "p", "max_tokens": 1})


def test_loading_an_adapter_under_the_served_models_name_is_refused():
    fake = _fake({"sql": "/sql"})
    settings = Settings(model_name="demo", triton_model="ensemble", lora_modules=("sql",),
                        allow_runtime_lora_updating=True)
    with serve_in_thread(create_app(settings, client=fake)) as url:
        for path in LOAD_PATHS:
            for name, why in (("demo", "is the served model's name"), ("ensemble", "is the Triton model's name"),
                              ("sql", "is already loaded")):
                r = httpx.post(url + path, json={"lora_name": name, "lora_path": "/adapter"})
                assert r.status_code == 400, (path, name, r.text)
                err = r.json()["error"]
                assert err["param"] == "lora_name" and f"'{name}' {why}" in err["message"], err
        assert fake.adapters == {"sql": "/sql"}  # nothing reached the engine
        assert _models(url) == [("demo", None), ("sql", "demo")]
        assert _complete(url, "demo").status_code == 200
        assert "lora_path" not in fake.requests[-1].sampling_params  # still the base model
        # a name of its own loads
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "demo2", "lora_path": "/d2"})
        assert r.status_code == 200 and fake.adapters["demo2"] == "/d2"
        assert _models(url) == [("demo", None), ("sql", "demo"), ("demo2", "demo")]


def test_the_default_served_name_is_refused_too():
    # no --model-name: the served name is the --tokenizer-path directory's
    settings = Settings(tokenizer_path="/models/Qwen2-0.5B/", allow_runtime_lora_updating=True)
    assert settings.lora_name_error("Qwen2-0.5B") == (
        "'Qwen2-0.5B' is the served model's name; a LoRA adapter needs a name of its own")
    assert settings.lora_name_error("ensemble") is not None  # the Triton model's name is an alias
    assert settings.lora_name_error("sql") is None


def test_the_engine_listing_an_adapter_named_as_the_served_model_does_not_hide_it():
    fake = _fake({"demo": "/d", "sql": "/sql"})  # an engine started with such an adapter
    settings = Settings(model_name="demo", allow_runtime_lora_updating=True)
    with serve_in_thread(create_app(settings, client=fake)) as url:
        assert _models(url) == [("demo", None), ("sql", "demo")]
        assert _complete(url, "demo").status_code == 200
        assert "lora_path" not in fake.requests[-1].sampling_params


@pytest.mark.parametrize("modules, message", [
    (("demo",), "'demo' is the served model's name"),
    (("sql", "ensemble"), "'ensemble' is the Triton model's name"),
    (("sql", "sql"), "LoRA adapter 'sql' is named twice"),
    (("",), "a LoRA adapter needs a name"),
])
def test_lora_modules_clashing_with_the_served_model_fail_at_startup(modules, message):
    with pytest.raises(ValueError, match=message):
        create_app(Settings(model_name="demo", lora_modules=modules), client=FakeLLMClient())


@pytest.mark.parametrize("argv, message", [
    (["--model-name", "demo", "--lora-modules", "demo=/a"], "--lora-modules: 'demo' is the served model's name"),
    (["--model-name", "demo", "--lora-modules", "sql=/a,sql=/b"], "--lora-modules: LoRA adapter 'sql' is named twice"),
    (["--tokenizer-path", "/m/tiny", "--lora-modules", "x=/x", "tiny=/t"], "--lora-modules: 'tiny' is the served"),
])
def test_cli_refuses_lora_modules_clashing_with_the_served_model(argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert str(exc.value).startswith(message)


@pytest.mark.parametrize("unload", UNLOAD_PATHS)
def test_an_unloaded_startup_adapter_leaves_v1_models_and_is_not_found(unload):
    fake = _fake({"sql": "/sql"})  # the engine started with lora_modules sql=/sql
    settings = Settings(model_name="demo", lora_modules=("sql",), allow_runtime_lora_updating=True)
    with serve_in_thread(create_app(settings, client=fake)) as url, \
            serve_in_thread(create_app(settings, client=fake)) as other:  # a second worker
        assert _models(url) == [("demo", None), ("sql", "demo")]
        assert _complete(url, "sql").status_code == 200
        assert fake.requests[-1].sampling_params["lora_path"] == "sql"
        assert httpx.post(url + unload, json={"lora_name": "sql"}).status_code == 200
        assert fake.adapters == {}
        assert _models(url) == [("demo", None)]
        for path, body in (("/v1/completions", {"prompt": "p"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = httpx.post(url + path, json={"model": "sql", "max_tokens": 1, **body})
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
        assert httpx.get(url + "/v1/models/sql").status_code == 404
        # the other worker learns it from the engine's list
        assert _models(other) == [("demo", None)]
        assert _complete(other, "sql").status_code == 404
        # loaded again, it is back in its place
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/sql"})
        assert r.status_code == 200, r.text
        assert _models(url) == [("demo", None), ("sql", "demo")]
        assert _complete(url, "sql").status_code == 200


def test_without_runtime_updating_the_startup_list_is_served_as_given():
    fake = _fake({})  # never asked: the frontend's list is --lora-modules
    with serve_in_thread(create_app(Settings(model_name="demo", lora_modules=("b", "a")), client=fake)) as url:
        assert _models(url) == [("demo", None), ("b", "demo"), ("a", "demo")]


def test_an_adapter_unloaded_through_another_worker_is_not_found_there_too():
    """Worker B still lists `sql` when worker A unloads it: the engine refuses B's request
    (400 on lora_path, as the real client maps it), which B answers as vLLM does, 404."""
    from openai_frontend.triton_errors import map_stream_error

    fake = FakeLLMClient()
    fake.adapters = {"sql": "/sql"}

    def script(req):
        lora = req.sampling_params.get("lora_path")
        if lora and lora not in fake.adapters:
            return map_stream_error(f"LoRA adapter '{lora}' is not loaded; loaded adapters: none")
        return text_chunks(["a"])

    fake.script = script
    settings = Settings(model_name="demo", lora_modules=("sql",), allow_runtime_lora_updating=True)
    with serve_in_thread(create_app(settings, client=fake)) as a, serve_in_thread(create_app(settings, client=fake)) as b:
        assert _complete(b, "sql").status_code == 200
        assert httpx.post(a + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        for path, body in (("/v1/completions", {"prompt": "p"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            for stream in (False, True):
                r = httpx.post(b + path, json={"model": "sql", "max_tokens": 1, "stream": stream, **body})
                assert r.status_code == 404, (path, stream, r.text)
                assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
        # an explicit lora_path (SGLang's extra) naming it stays the parameter's error
        r = httpx.post(b + "/v1/completions", json={"model": "demo", "lora_path": "sql", "prompt": "p", "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text


@pytest.mark.parametrize("unload, status, message", [
    ("/unload_lora_adapter", 400, "LoRA adapter 'gone' is not loaded"),  # SGLang: a 400
    ("/v1/unload_lora_adapter", 404, "The lora adapter 'gone' cannot be found."),  # vLLM's NotFoundError
])
def test_unloading_an_adapter_that_is_not_loaded_names_lora_name(unload, status, message):
    # QA: a 400 that blamed `lora_path`, a field an unload request does not have.
    fake = _fake({"sql": "/sql"})
    settings = Settings(model_name="demo", allow_runtime_lora_updating=True)
    with serve_in_thread(create_app(settings, client=fake)) as url:
        r = httpx.post(url + unload, json={"lora_name": "gone"})
        assert r.status_code == status, r.text
        assert r.json()["error"]["message"] == message and r.json()["error"]["param"] == "lora_name"
        assert fake.adapters == {"sql": "/sql"}


def test_without_a_model_name_requests_may_name_the_model_by_its_path():
    # vLLM and SGLang name a model by the path they were given unless told otherwise (QA: a
    # client sending `/models/X` got 404 model_not_found); /v1/models lists the short name.
    fake = _fake({})
    with serve_in_thread(create_app(Settings(tokenizer_path="/models/Qwen2-0.5B/"), client=fake)) as url:
        assert _models(url) == [("Qwen2-0.5B", None)]
        for name in ("Qwen2-0.5B", "/models/Qwen2-0.5B", "/models/Qwen2-0.5B/"):
            assert _complete(url, name).status_code == 200, name
        assert _complete(url, "/models/other").status_code == 404
    assert Settings(tokenizer_path="/models/Qwen2-0.5B").lora_name_error("/models/Qwen2-0.5B") == (
        "'/models/Qwen2-0.5B' is the served model's path, which requests may give for it; a LoRA adapter needs "
        "a name of its own")
    with serve_in_thread(create_app(Settings(model_name="demo", tokenizer_path="/models/Qwen2-0.5B"),
                                    client=fake)) as url:  # --served-model-name: that name only, as in vLLM
        assert _complete(url, "/models/Qwen2-0.5B").status_code == 404
        assert _complete(url, "demo").status_code == 200
