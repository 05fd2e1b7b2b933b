"""KV-cache hand-off from a prefill engine (P) to a decode engine (D).

    layout.py        the KV layout both sides must share (checked before any byte moves)
    messages.py      the msgspec messages of one hand-off; block frames carry raw KV bytes
    connector.py     the connector interface (KVProducer on P, KVConsumer on D) and its
                     engine-backed implementation: which blocks move, where they land
    group.py         a moved n > 1 request's samples as one transfer table (shared blocks once)
    local.py         both engines in one process: the hand-off as plain calls
    zmq_transport.py the plain ZMQ/TCP path (CPU runs, CI): P sends checked block frames
    shm.py           same-host frames: the payloads through a POSIX shared-memory ring
    cuda_ipc.py      same-host cache reads: D copies P's blocks out of P's exported cache
                     (CUDA IPC; a CPU cache through shared memory)
    nixl_transport.py the NIXL path (the `nixl` extra): D reads P's registered blocks directly
    rate_limit.py    one log line per interval for dropped frames
"""
