"""The one exception type for bad input: what a caller sent that the engine cannot use.

Validation anywhere (a sampling field, a chat template's variables, an adapter's rank or pattern, an
announced tensor size) raises ``InputError`` with a message naming what to fix. The server maps it to
400 in every route family, whatever other exception it stands for (a ``re.error``, a pydantic
``ValidationError`` met inside a handler, a template that refuses a conversation): one type, so no
route's list of caught classes can miss one. It is a ``ValueError``, so callers that caught
``ValueError`` for bad input still do.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input, named in the message; nothing was changed by the call that raised it."""
