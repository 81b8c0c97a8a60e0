"""The rollout server (``rollout serve``): SGLang's and OpenAI's routes over one ``RolloutEngine``,
and ``RolloutClient``, the engine's verbs over HTTP. Needs the ``serve`` extra (FastAPI, uvicorn,
prometheus_client, httpx). ``launch_server`` starts ``rollout serve`` in a child process and waits
for it."""

from rollout.server.client import RolloutClient, RolloutServerError
from rollout.server.launch import ServerProcess, launch_server

__all__ = ["RolloutClient", "RolloutServerError", "ServerProcess", "launch_server"]
