"""A request's conversation key: what the scheduler routes a conversation's turns by.

Clients name a conversation with OpenAI's `user` (one end user, one running chat) or with the
`conversation_id` extension (one of several chats of a user), which wins when both are given.
The scheduler gets a digest of (tenant, value), never the text: the value stays in this process,
cannot reach a log or a metric label there, and one tenant's value cannot name another tenant's
conversation (the scheduler keys its table by tenant too).
"""
from __future__ import annotations

import hashlib

from services.gateway.schemas import bad

MAX_CONVERSATION_CHARS = 256


def conversation_key(tenant: str, user: str | None, conversation_id: str | None) -> str:
    """32 hex characters, or "" when the request names no conversation; ApiError 400 past the bound."""
    for name, value in (("conversation_id", conversation_id), ("user", user)):
        if value is not None and len(value) > MAX_CONVERSATION_CHARS:
            raise bad(f"{name} must have at most {MAX_CONVERSATION_CHARS} characters", name)
    value = conversation_id or user
    if not value:
        return ""
    kind = "c" if conversation_id else "u"   # a user and a conversation of the same text stay apart
    return hashlib.blake2b(f"{tenant}\0{kind}\0{value}".encode(), digest_size=16).hexdigest()
