"""KV-cache hand-off from a prefill engine (P) to a decode engine (D).

    layout.py        the KV layout both sides must share (checked before any byte moves)
    messages.py      the msgspec messages of one hand-off; block frames carry raw KV bytes
    connector.py     the connector interface (KVProducer on P, KVConsumer on D) and its
                     engine-backed implementation: which blocks move, where they land
    zmq_transport.py the plain ZMQ/TCP path (CPU runs, CI); NIXL would replace only this part
    rate_limit.py    one log line per interval for dropped frames
"""
