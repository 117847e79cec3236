"""/v1/embeddings (openai_frontend/embeddings.py) with the official openai SDK against the frontend
on a scripted engine: pooling, normalization, dimensions, both encodings, batches, and the
refusals. On tritonserver, against Hugging Face's hidden states: test_openai_sdk.py."""

from __future__ import annotations

import base64
import json
import math
import struct

import httpx
import openai
import pytest

from openai_frontend.embeddings import pooled
from openai_frontend.engine_types import EngineChunk
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import FakeLLMClient, serve_in_thread

MODEL = "m"


def _rows(request) -> list[list[float]]:
    """A stand-in prompt's hidden rows: token t's row is [t, 1, -t/2, 3] (text: its UTF-8 bytes)."""
    ids = request.input_ids if request.input_ids is not None else list(request.text_input.encode())
    return [[float(t), 1.0, -t / 2, 3.0] for t in ids]


def _script(request):
    rows = _rows(request)
    assert request.sampling_params == {"max_new_tokens": 1, "temperature": 0, "return_hidden_states": True}
    return [EngineChunk(text="x", token_ids=[7], finish_reason="length", prompt_tokens=len(rows), completion_tokens=1,
                        meta_raw=json.dumps({"hidden_states": [rows, [0.0, 0.0, 0.0, 0.0]]}))]


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient(script=_script)


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_inputs_are_pooled_normalized_and_cut_to_dimensions(fake, pooling):
    with serve_in_thread(create_app(Settings(model_name=MODEL, embeddings_pooling=pooling), client=fake)) as url:
        sdk = _sdk(url)
        # The SDK asks for base64 unless told otherwise, and decodes it itself.
        for encoding in ({"encoding_format": "float"}, {}):
            for inputs, prompts in ((["ab", "c"], ([97, 98], [99])), ([[5, 6, 7], [8]], ([5, 6, 7], [8]))):
                r = sdk.embeddings.create(model=MODEL, input=inputs, **encoding)
                assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
                assert r.usage.prompt_tokens == sum(map(len, prompts))
                for d, ids in zip(r.data, prompts):
                    rows = [[float(t), 1.0, -t / 2, 3.0] for t in ids]
                    raw = rows[-1] if pooling == "last" else [sum(c) / len(rows) for c in zip(*rows)]
                    norm = math.sqrt(sum(x * x for x in raw))
                    assert d.embedding == pytest.approx([x / norm for x in raw], rel=1e-6)
        cut = sdk.embeddings.create(model=MODEL, input=[1, 2], dimensions=2).data[0].embedding
        assert len(cut) == 2 and math.isclose(math.hypot(*cut), 1.0, rel_tol=1e-6)
        raw = httpx.post(url + "/v1/embeddings", json={"input": "a", "encoding_format": "float"}).json()
        packed = httpx.post(url + "/v1/embeddings", json={"input": "a", "encoding_format": "base64"}).json()
        floats = struct.unpack("<4f", base64.b64decode(packed["data"][0]["embedding"]))  # little-endian float32
        assert list(floats) == pytest.approx(raw["data"][0]["embedding"], rel=1e-6) and raw["object"] == "list"


def test_the_route_is_refused_unless_pooling_is_on_and_bad_inputs_are_400s(fake):
    with serve_in_thread(create_app(Settings(model_name=MODEL), client=fake)) as url:
        with pytest.raises(openai.BadRequestError, match="--embeddings-pooling last"):
            _sdk(url).embeddings.create(model=MODEL, input="hi")
    with serve_in_thread(create_app(Settings(model_name=MODEL, embeddings_pooling="last"), client=fake)) as url:
        for body, param in [({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[]]}, "input"),
                            ({"input": [1, "a"]}, "input"), ({"input": "x", "dimensions": 0}, "dimensions"),
                            ({"input": "x", "dimensions": 5}, "dimensions"), ({"input": "x", "encoding_format": "hex"},
                                                                             "encoding_format"),
                            ({"input": "x", "pooling": "cls"}, "pooling"), ({"input": ["x"] * 2049}, "input")]:
            r = httpx.post(url + "/v1/embeddings", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert httpx.post(url + "/v1/embeddings", json={"input": "x", "model": "nope"}).status_code == 404


def test_pooling_a_zero_vector_stays_zero():
    assert pooled([[0.0, 0.0]], "last", None) == [0.0, 0.0]
