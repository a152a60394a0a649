"""The smallest Serve application `tools/launch.serve_run` calls ready (a model listed,
a completion answered), for tests of the launcher itself: it starts in seconds, with no
engine (tests/test_launch.py)."""

from fastapi import FastAPI
from ray import serve

app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Echo:
    @app.get("/v1/models")
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": "echo", "object": "model"}]}

    @app.post("/v1/completions")
    def completions(self) -> dict:
        return {"object": "text_completion", "choices": [{"index": 0, "text": "ready"}]}


echo = Echo.bind()
