"""A decode engine in a process of its own behind the ZMQ hand-off endpoint (for
test_zmq_transport.py): prints {"port": N}, serves until `expected` requests have finished (or
`deadline_s` passed), then prints what it produced and exits.

    python decode_process.py MODEL_DIR EXPECTED DEADLINE_S
"""
from __future__ import annotations

import json
import sys
import time

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.engine import Engine
from gpu_worker.kv_transfer.connector import EngineKVConsumer
from gpu_worker.kv_transfer.zmq_transport import KVReceiverEndpoint


def main(model_dir: str, expected: int, deadline_s: float) -> None:
    torch.set_num_threads(1)
    eng = Engine(EngineConfig(model=model_dir, device="cpu", num_gpu_blocks=64))
    consumer = EngineKVConsumer(eng)
    endpoint = KVReceiverEndpoint(consumer, "127.0.0.1")
    print(json.dumps({"port": endpoint.port}), flush=True)
    tokens: dict[str, dict[int, list[int]]] = {}
    finished: set[tuple[str, int]] = set()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not (len({r for r, _ in finished}) >= expected
                                               and not eng.has_unfinished_requests()):
        endpoint.poll(0 if eng.has_unfinished_requests() else 20)
        if eng.has_unfinished_requests():
            for d in eng.step():
                tokens.setdefault(d.request_id, {}).setdefault(d.index, []).extend(d.new_token_ids)
                if d.finish_reason is not None:
                    finished.add((d.request_id, d.index))
    eng.block_manager.check_integrity()
    print(json.dumps({"tokens": tokens, "used_blocks": eng.block_manager.num_used_blocks,
                      "messages_dropped": endpoint.messages_dropped, "frames_dropped": consumer.frames_dropped,
                      "blocks_received": consumer.blocks_received}), flush=True)
    endpoint.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
