"""The NIXL path of the KV hand-off: D reads the blocks it lacks straight out of P's registered
KV cache (a one-sided READ through UCX: host memory here; CUDA IPC, NVLink or RDMA on GPUs). No
BlockFrame is sent: the Offer (P's block ids) and D's Accept (its own) are the descriptors, and
the READ's completion takes the frames' place (consumer.written_directly, then Done/Ack).

    P  source = NixlKVAgent(p_engine, "p0");  peer = source.peer()   (sent to D once)
    D  reader = NixlKVReader(consumer, NixlKVAgent(d_engine, "d0")); reader.connect(peer)
    D  accept = consumer.accept(offer); answer = reader.pull(offer, accept)   -> Ack | Fail
    P  producer.release(rid) on the Ack / Fail (or NIXL's notification, which carries rid)

`nixl` (PyPI, the `nixl` extra) is imported only when an agent is made.
"""
from __future__ import annotations

import os
import time

import msgspec

from gpu_worker.kv_transfer.connector import EngineKVConsumer
from gpu_worker.kv_transfer.layout import KVLayout, check_compatible, handoff_caches, handoff_layout
from gpu_worker.kv_transfer.messages import Accept, Ack, Done, Fail, Offer


class NixlPeer(msgspec.Struct, frozen=True):
    """What a reader needs to know of a source agent: sent once per P/D pair."""
    name: str
    metadata: bytes                 # NIXL agent metadata (connection info, registrations)
    layout: KVLayout
    base_addrs: list[int]           # per cache tensor, layer-major, K then V
    block_bytes: int
    num_blocks: int
    device_id: int


class NixlKVAgent:
    """One engine's NIXL agent (UCX backend) with every layer's K and V cache registered."""

    def __init__(self, engine, name: str, ucx_devices: str = "lo") -> None:
        """ucx_devices: the devices UCX may listen and connect on (UCX_NET_DEVICES syntax,
        e.g. "mlx5_0:1,eth0"); loopback by default, like every kvmesh socket. The backend
        parameter alone leaves UCX's TCP listener on every interface, so the process's
        UCX_NET_DEVICES gets it too, unless the environment already sets it."""
        from nixl._api import nixl_agent, nixl_agent_config   # optional dependency
        self.name = name
        self.layout = handoff_layout(engine)
        self.caches = [t for kv in handoff_caches(engine) for t in kv]   # MTP's K, V last
        first = self.caches[0]
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.device_id = (first.device.index or 0) if first.is_cuda else 0
        self.block_bytes = first.stride(0) * first.element_size()
        self.num_blocks = int(first.shape[0])
        os.environ.setdefault("UCX_NET_DEVICES", ucx_devices)   # read when UCX starts, below
        self.agent = nixl_agent(name, nixl_agent_config(backends=[]))
        self.agent.create_backend("UCX", {"ucx_devices": ucx_devices})
        self._registration = self.agent.register_memory(self.caches)

    def peer(self) -> NixlPeer:
        return NixlPeer(self.name, self.agent.get_agent_metadata(), self.layout,
                        [t.data_ptr() for t in self.caches], self.block_bytes, self.num_blocks, self.device_id)

    def descriptors(self, bases: list[int], block_ids: list[int], device_id: int):
        """One (address, bytes, device) per cache tensor and block, tensor-major."""
        return self.agent.get_xfer_descs([(base + b * self.block_bytes, self.block_bytes, device_id)
                                          for base in bases for b in block_ids], self.mem_type)

    def close(self) -> None:
        self.agent.deregister_memory(self._registration)


class NixlKVReader:
    """D's side: reads accepted requests' missing blocks from a connected source agent."""

    def __init__(self, consumer: EngineKVConsumer, agent: NixlKVAgent) -> None:
        self.consumer = consumer
        self.agent = agent
        self._peers: dict[str, NixlPeer] = {}

    def connect(self, peer: NixlPeer) -> None:
        """Raises KVLayoutMismatch (before any byte moves) when the source's layout differs. A
        source already connected with the same metadata is left as it is."""
        known = self._peers.get(peer.name)
        if known is not None and known.metadata == peer.metadata:
            return
        check_compatible(self.agent.layout, peer.layout)
        if len(peer.base_addrs) != len(self.agent.caches) or peer.block_bytes != self.agent.block_bytes:
            raise ValueError("the source's KV cache tensors do not match this engine's")
        self.agent.agent.add_remote_agent(peer.metadata)
        self._peers[peer.name] = peer

    def pull(self, source: str, offer: Offer, accept: Accept, timeout_s: float = 30.0) -> Ack | Fail:
        """READ the blocks D lacks from `source`, then admit the request (or fail it: blocks freed)."""
        rid, peer = accept.request_id, self._peers.get(source)
        src = offer.src_block_ids[accept.first_block:]
        if peer is None or len(src) != len(accept.dst_block_ids) or not all(0 <= b < peer.num_blocks for b in src):
            self.consumer.abort(rid)
            return Fail(rid, "no connected source, or source block ids out of range")
        if src:
            agent = self.agent.agent
            local = self.agent.descriptors([t.data_ptr() for t in self.agent.caches], accept.dst_block_ids,
                                           self.agent.device_id)
            remote = self.agent.descriptors(peer.base_addrs, src, peer.device_id)
            handle = agent.initialize_xfer("READ", local, remote, peer.name, rid.encode())
            try:
                state, deadline = agent.transfer(handle), time.monotonic() + timeout_s
                while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                    time.sleep(0.0005)
                    state = agent.check_xfer_state(handle)
            finally:
                agent.release_xfer_handle(handle)
            if state != "DONE":
                self.consumer.abort(rid)
                return Fail(rid, f"NIXL READ ended {state if state == 'ERR' else 'in a timeout'}")
        if not self.consumer.written_directly(rid):
            return Fail(rid, "no transfer in progress for it")
        return self.consumer.complete(Done(rid, 0))


def encode_peer(peer: NixlPeer) -> bytes:
    return msgspec.msgpack.encode(peer)


def decode_peer(data: bytes) -> NixlPeer:
    """Raises ValueError on anything that is not one well-formed NixlPeer."""
    try:
        return msgspec.msgpack.decode(data, type=NixlPeer)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"malformed NIXL source: {e}") from None
