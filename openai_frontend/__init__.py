"""OpenAI / SGLang-compatible HTTP frontend for the Triton `ensemble` model.

    from openai_frontend import Settings, create_app
    app = create_app(Settings(triton_url="localhost:8001", model_name="demo"))

Run: python -m openai_frontend --triton-url localhost:8001 --model-name demo --port 9000
"""

from openai_frontend.settings import Settings


def create_app(*args, **kwargs):  # imported lazily: keeps `import openai_frontend` light
    from openai_frontend.server import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["Settings", "create_app"]
