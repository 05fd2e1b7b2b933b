"""The conversation key the gateway sends the scheduler: from `user` or `conversation_id`, bounded,
a digest per tenant (never the client's text), and bounded again on the wire."""
from __future__ import annotations

import msgspec
import pytest

from services.gateway.conversation import MAX_CONVERSATION_CHARS, conversation_key
from services.gateway.schemas import ApiError, ChatRequest, CompletionRequest, decode
from services.protocol.messages import MAX_CONVERSATION_KEY, Submit
from services.protocol.sampling import SamplingParams


def test_user_or_conversation_id_make_a_tenant_bound_digest():
    alice = conversation_key("key0", "alice", None)
    assert len(alice) == 32 and "alice" not in alice
    assert alice == conversation_key("key0", "alice", None)                   # stable: the turns agree
    assert alice != conversation_key("key1", "alice", None)                   # another tenant, another key
    assert conversation_key("key0", "alice", "chat-7") == conversation_key("key0", None, "chat-7")  # id wins
    assert conversation_key("key0", None, "alice") != alice                   # a user and a chat stay apart
    assert conversation_key("key0", None, None) == conversation_key("key0", "", None) == ""


@pytest.mark.parametrize("field", ["user", "conversation_id"])
def test_a_long_value_is_a_400_naming_the_field(field):
    kw = {field: "x" * (MAX_CONVERSATION_CHARS + 1)}
    with pytest.raises(ApiError) as err:
        conversation_key("t", kw.get("user"), kw.get("conversation_id"))
    assert err.value.status == 400 and err.value.param == field
    conversation_key("t", "x" * MAX_CONVERSATION_CHARS, None)                  # at the bound: fine


def test_both_endpoints_take_the_fields():
    chat = decode(ChatRequest, b'{"messages": [{"role": "user", "content": "hi"}], "user": "u1"}')
    comp = decode(CompletionRequest, b'{"prompt": "hi", "conversation_id": "c1"}')
    assert (chat.user, chat.conversation_id, comp.user, comp.conversation_id) == ("u1", None, None, "c1")
    with pytest.raises(ApiError) as err:
        decode(ChatRequest, b'{"messages": [{"role": "user", "content": "hi"}], "user": 5}')
    assert err.value.param == "user"


def test_submit_refuses_a_longer_key_on_the_wire():
    base = dict(request_id="r", tenant="t", prompt_token_ids=[1], params=SamplingParams(), reply_addr="a",
                detok_addr="b")
    ok = msgspec.msgpack.encode(Submit(**base, conversation="a" * MAX_CONVERSATION_KEY))
    assert msgspec.msgpack.decode(ok, type=Submit).conversation == "a" * MAX_CONVERSATION_KEY
    too_long = msgspec.msgpack.encode(Submit(**base, conversation="a" * (MAX_CONVERSATION_KEY + 1)))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(too_long, type=Submit)
