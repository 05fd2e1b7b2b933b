"""Every message that crosses a process boundary, as frozen msgspec Structs (msgpack on the wire).

Split by destination: `sampling` (request parameters, shared with the offline API) and the
service messages added beside it. No pickle anywhere: encode/decode with msgspec only.
"""
from services.protocol.sampling import SamplingParams, SamplingParamsError

__all__ = ["SamplingParams", "SamplingParamsError"]
