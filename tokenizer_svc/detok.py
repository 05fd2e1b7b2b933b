"""The streaming detokenizer's core: services/text/streams.py (the gateway runs it too, with
--local-detokenizer, and a service imports only services/ and itself)."""
from services.text.streams import SCHEDULER, STREAM_MAX_AGE_S, DetokCore, Envelope

__all__ = ["SCHEDULER", "STREAM_MAX_AGE_S", "DetokCore", "Envelope"]
