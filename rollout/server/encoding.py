"""JSON as the server writes it: strict (no ``NaN`` / ``Infinity``, which strict parsers refuse) and
ASCII-safe (``\\u`` escapes, so no string can fail to encode).

A value that has no JSON number (the ``-inf`` logprob of a token that top-k or a mask ruled out, a
``NaN`` row) is written as ``null``, as SGLang's ``/generate`` writes it (orjson); the OpenAI routes
clamp logprobs to ``-9999.0`` first (``openai_logprob``), as vLLM does, since OpenAI clients expect
numbers there. The common case costs one ``json.dumps``; only a body that holds such a value is
walked.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from starlette.responses import JSONResponse as _StarletteJSON

OPENAI_MIN_LOGPROB = -9999.0  # vLLM's floor for logprobs in its OpenAI-compatible responses


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a non-finite float somewhere: null, as SGLang writes it
        return json.dumps(_finite(obj), ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def openai_logprob(x: Optional[float]) -> Optional[float]:
    """A logprob as the OpenAI routes write it: ``-inf`` (and NaN) as ``OPENAI_MIN_LOGPROB``; None
    (a prompt's first token, which nothing precedes) stays None."""
    return x if x is None or math.isfinite(x) else OPENAI_MIN_LOGPROB


class JSONResponse(_StarletteJSON):
    """Every JSON answer of the server (``FastAPI(default_response_class=...)`` and the handlers)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("ascii")


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {dumps(obj)}\n\n"


def vllm_error(status: int, message: str) -> JSONResponse:
    """vLLM's control routes answer failures as ``{"error": ...}`` (vLLM's, prime-rl's and SkyRL's routes)."""
    return JSONResponse({"error": message}, status_code=status)
