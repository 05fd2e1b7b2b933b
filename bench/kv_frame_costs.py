"""Where the time of one P/D hand-off's frames goes, per transport, without engines: 1,024 tokens of
Llama-3.1-8B's KV (32 layers x 8 KV heads x 128 x bf16 = 128 MiB) moved the way the hand-off moves
them: P gathers the blocks layer by layer into frames and computes their xxh3, the frames go over a
loopback ZMQ socket (CURVE, as between workers, or plaintext) or through the shared-memory ring
(kv_transfer/shm.py, the header still over ZMQ), and D checks each frame's xxh3 and copies it into
its blocks with index_copy_. P and D run on two threads of this process (the workers are two
processes: on a loaded 2-core machine pass --threads 1).

    python bench/kv_frame_costs.py                  # CPU tensors
    python bench/kv_frame_costs.py --device cuda    # the caches on the GPU (D2H / H2D included)
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time

import torch
import zmq

from gpu_worker.kv_transfer import shm
from gpu_worker.kv_transfer.messages import checksum
from services.security import bundle
from services.security.curve import Plane

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 32, 8, 128, 16, 64       # 64 blocks x 16 = 1,024 tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev, dt = torch.device(args.device), torch.bfloat16
    shape = (256, BLOCK, KV_HEADS, HEAD_DIM)
    src = [(torch.randn(shape, device=dev).to(dt), torch.randn(shape, device=dev).to(dt)) for _ in range(LAYERS)]
    dst = [(torch.zeros(shape, device=dev, dtype=dt), torch.zeros(shape, device=dev, dtype=dt)) for _ in range(LAYERS)]
    table = list(range(3, 3 + 2 * BLOCKS, 2))           # (blocks,) P's blocks, D's alike
    total = 2 * LAYERS * BLOCKS * BLOCK * KV_HEADS * HEAD_DIM * 2

    def frames(frame_bytes: int):
        """(D's block ids, frame shape, payload) as the producer makes them: all layers of a few blocks."""
        nb = max(1, frame_bytes // (2 * LAYERS * BLOCK * KV_HEADS * HEAD_DIM * 2))
        for b0 in range(0, BLOCKS, nb):
            idx = torch.tensor(table[b0:b0 + nb], device=dev)
            kv = torch.empty((LAYERS, 2, len(idx), BLOCK, KV_HEADS, HEAD_DIM), dtype=dt, device=dev)
            for i, (k, v) in enumerate(src):
                torch.index_select(k, 0, idx, out=kv[i, 0])
                torch.index_select(v, 0, idx, out=kv[i, 1])
            payload = memoryview(kv.contiguous().view(torch.uint8).cpu().numpy()).cast("B")
            yield idx, kv.shape, payload

    def write(idx, kv_shape, payload) -> None:
        kv = torch.frombuffer(payload, dtype=torch.uint8).view(dt).view(kv_shape).to(dev)
        for i, (k, v) in enumerate(dst):
            k.index_copy_(0, idx, kv[i, 0])
            v.index_copy_(0, idx, kv[i, 1])
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def over_zmq(planes, frame_bytes: int) -> float:
        ctx = zmq.Context.instance()
        r, s = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        if planes:
            planes[0].serve(r, ("worker",))
            planes[1].connect(s, "worker")
        s.connect(f"tcp://127.0.0.1:{r.bind_to_random_port('tcp://127.0.0.1')}")
        meta: list = []
        got = threading.Semaphore(0)

        def receive() -> None:
            for _ in range(-(-BLOCKS // max(1, frame_bytes // (2 * LAYERS * BLOCK * KV_HEADS * HEAD_DIM * 2)))):
                _, _, frame = r.recv_multipart(copy=False)
                got.acquire()
                idx, kv_shape = meta.pop(0)
                checksum(frame.buffer)
                write(idx, kv_shape, frame.buffer)

        t0 = time.perf_counter()
        rx = threading.Thread(target=receive)
        rx.start()
        for idx, kv_shape, payload in frames(frame_bytes):
            checksum(payload)
            meta.append((idx, kv_shape))
            got.release()
            s.send_multipart([b"h", payload], copy=False)
        rx.join()
        elapsed = time.perf_counter() - t0
        r.close(0)
        s.close(0)
        return elapsed

    ring, reader = shm.SegmentRing(), shm.RingReader()

    def over_ring(frame_bytes: int) -> float:
        t0 = time.perf_counter()
        for idx, kv_shape, payload in frames(frame_bytes):
            checksum(payload)
            placed = ring.place(payload)
            with reader.read(ring.name, placed.offset, len(payload), placed.end) as view:
                checksum(view)
                write(idx, kv_shape, view)
        return time.perf_counter() - t0

    trust = tempfile.mkdtemp()
    bundle.generate(trust)
    planes = (Plane.load(trust, "worker"), Plane.load(trust, "worker"))
    runs = [("zmq CURVE, 64 MiB frames", lambda: over_zmq(planes, 64 << 20)),
            ("zmq CURVE, 4 MiB frames (the producer's default)", lambda: over_zmq(planes, 4 << 20)),
            ("zmq plaintext, 4 MiB frames", lambda: over_zmq(None, 4 << 20)),
            ("shm ring, 4 MiB frames (P then D, one thread)", lambda: over_ring(4 << 20))]
    try:
        for label, run in runs:
            run()                                      # warm: connections, the ring's pages
            t = sorted(run() for _ in range(args.repeats))[args.repeats // 2]
            print(f"{label:50s} {t * 1e3:8.1f} ms  {total / t / 1e9:6.2f} GB/s  (128 MiB, median of {args.repeats})")
    finally:
        ring.close()
        reader.close()


if __name__ == "__main__":
    main()
