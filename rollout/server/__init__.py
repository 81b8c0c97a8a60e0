"""The rollout server (``rollout serve``): SGLang's and OpenAI's routes over one ``RolloutEngine``,
and ``RolloutClient``, the engine's verbs over HTTP. Needs the ``serve`` extra (FastAPI, uvicorn,
prometheus_client, httpx)."""

from rollout.server.client import RolloutClient, RolloutServerError

__all__ = ["RolloutClient", "RolloutServerError"]
