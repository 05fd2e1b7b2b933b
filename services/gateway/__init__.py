"""The OpenAI-compatible HTTP gateway (`kvmesh gateway`)."""
