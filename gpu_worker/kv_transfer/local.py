"""Both engines in one process: the hand-off as plain calls (tests, measurements). The
messages are the same ones a socket transport carries."""
from __future__ import annotations

from gpu_worker.kv_transfer.connector import KVConsumer, KVProducer
from gpu_worker.kv_transfer.messages import Accept, Ack, Fail, Refuse


def hand_off(producer: KVProducer, consumer: KVConsumer, request_id: str) -> Ack | Fail | Refuse | None:
    """Move one exported request from producer to consumer; P's blocks are released after D's
    answer (Ack, Fail or Refuse). None when the request has nothing to hand off."""
    offer = producer.offer(request_id)
    if offer is None:
        return None
    answer = consumer.accept(offer)
    if isinstance(answer, Accept):
        for frame, payload in producer.frames(answer):
            if (failed := consumer.receive(frame, payload)) is not None:
                answer = failed
                break
        else:
            answer = consumer.complete(producer.done(request_id))
    producer.release(request_id)
    return answer
