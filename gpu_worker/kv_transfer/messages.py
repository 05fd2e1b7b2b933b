"""The messages of one KV hand-off (msgspec msgpack; never pickle).

    P -> D  Offer       the request, its first token(s), the chained hashes of its full prompt
                        blocks and P's KV layout. Streamed (no first tokens yet): sent while P
                        still prefills, its frames follow chunk by chunk, the first tokens come
                        with Done
    D -> P  Accept      D's layout and the blocks P must send: from `first_block` on (the ones
                        before are prefix hits on D), with D's block id for each
         or Refuse      layout mismatch, invalid request, no free blocks: nothing moves
    P -> D  BlockFrame  header + one raw payload frame: K and V of layers [layer_start,
                        layer_end) for blocks [block_start, block_start + len(dst_block_ids))
                        of the block table, shape (layers, 2, blocks, block_size, kv_heads,
                        head_dim), `checksum` = xxh3-128 of the payload (catches corruption
                        and framing bugs, ~10x blake2b's speed; integrity against an attacker is
                        the authenticated plane's job)
                        With `segment` (same host, D's Accept said `shm`) there is no payload
                        frame: the payload is in that shared-memory ring
    P -> D  Done        every frame is sent (`num_frames` of them; in any order before it); a
                        streamed Offer's first tokens
                        With method mtp (layout.mtp_layers == 1) the frames carry the MTP layer's
                        KV as the layer after the target's, and the Offer (with its samples) or
                        Done carries `last_hidden`: what D's MTP layer needs to draft at once
    D -> P  Ack         D holds every block and decodes: P may release its blocks
         or Fail        D dropped the request (bad frame, abort): P releases its blocks
    either  Abort       the other side stops and frees the request's blocks
    P -> D  NixlSource  (NIXL transport) P's agent: metadata and cache addresses, before its Offers;
                        D then reads the blocks itself (no BlockFrame, no Done) and answers Ack/Fail

Same-host cache reads (kv_transfer/cuda_ipc.py): the Offer carries P's `cache_source` (its KV
cache tensors exported as CUDA IPC handles, or shared-memory files for a CPU cache); D answers
`Accept.reads_cache` when it opened that source; then no BlockFrame moves: P's Done lists the
source blocks D reads and how long P holds them, D copies them cache to cache and answers Ack.
A D that cannot open the source accepts without `reads_cache` and the frames go as usual.
"""
from __future__ import annotations

from typing import Annotated

import msgspec
import xxhash

from gpu_worker.kv_transfer.layout import KVLayout
from services.protocol.sampling import SamplingParams

MAX_HEADER_BYTES = 1 << 20          # an Offer of a 128k-token prompt is ~0.6 MB
CHECKSUM_BYTES = 16


MAX_CACHE_TENSORS = 1024             # K and V of up to 512 layers
Handle = Annotated[bytes, msgspec.Meta(max_length=512)]


class SharedTensor(msgspec.Struct, array_like=True, frozen=True):
    """One KV cache tensor of P as another process on its host opens it (cuda_ipc.CacheSharing).
    CUDA: torch's `_share_cuda_()` fields; CPU: a torch shared-memory file and its manager."""
    handle: Handle                  # cudaIpcMemHandle | the file's name (/torch_<pid>_<n>_<n>)
    storage_bytes: int
    storage_offset_bytes: int       # CUDA: the storage's offset in its IPC allocation; CPU: 0
    offset: int                     # the tensor's offset in its storage, in elements
    ref_counter: Handle = b""       # CUDA: torch's ref-counter file; CPU: torch_shm_manager's socket
    ref_counter_offset: int = 0
    event: Handle = b""             # CUDA: the IPC event P recorded when it exported
    event_sync: bool = False


class CacheSource(msgspec.Struct, frozen=True):
    """P's KV cache, exported once (cuda_ipc.export_cache); D opens it once per source_id."""
    source_id: Annotated[str, msgspec.Meta(max_length=64)]     # random per export
    kind: Annotated[str, msgspec.Meta(max_length=16)]          # "cuda_ipc" | "cpu_shm"
    host: Annotated[str, msgspec.Meta(max_length=512)]         # shm.host_identity() of P
    device: Annotated[str, msgspec.Meta(max_length=64)]        # the CUDA device's UUID, "cpu"
    layout: KVLayout
    num_blocks: int                 # of each cache tensor: (num_blocks, block_size, kv heads, head dim)
    tensors: Annotated[list[SharedTensor], msgspec.Meta(max_length=MAX_CACHE_TENSORS)]  # K, V per layer


MAX_HIDDEN_BYTES = 1 << 18          # one hidden state of width 32768 in float64: above any model's


class LastHidden(msgspec.Struct, array_like=True, frozen=True):
    """The target's pre-norm hidden state at the last prompt position, raw bytes of one (H,)
    tensor: with method mtp (layout.mtp_layers) the MTP layer's first draft on D reads it
    (spec_decode/mtp.py), as it would have on an engine that prefilled the prompt itself."""
    dtype: Annotated[str, msgspec.Meta(max_length=32)]          # torch dtype name, e.g. "bfloat16"
    data: Annotated[bytes, msgspec.Meta(max_length=MAX_HIDDEN_BYTES)]


class SampleStart(msgspec.Struct, array_like=True, frozen=True):
    index: int
    token_id: int
    cumulative_logprob: float


class MovedOutput(msgspec.Struct, array_like=True, frozen=True):
    """A sample of a moved n > 1 request: its output whose KV moves (all but its last token,
    which its SampleStart carries)."""
    index: int
    token_ids: list[int]


class Offer(msgspec.Struct, tag="offer", frozen=True):
    request_id: str
    layout: KVLayout
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    samples: list[SampleStart]      # [] when streamed: P still prefills, Done carries them
    block_hashes: list[bytes]       # full prompt blocks, chained (services/prefix_hash.py)
    num_blocks: int                 # blocks of the prompt (full ones + a partial last one)
    src_block_ids: list[int] = []   # P's block table: what a reading transport (NIXL) reads
    priority: int = 0
    cache_salt: str = ""
    num_cached_tokens: int = 0
    nixl_source: str = ""           # NIXL transport: the agent D reads the blocks from (NixlSource)
    shm_host: str = ""              # P's host identity (shm.host_identity) when P may write its
                                    # frames' payloads into shared memory
    cache_source: CacheSource | None = None   # D may read the blocks from P's cache (same host)
    last_hidden: LastHidden | None = None     # method mtp, with `samples` (else Done carries it)
    # a peer move of a decoding request: the last this many of prompt_token_ids are tokens it
    # generated (D counts them as output: budget, penalties, seeded positions); 0 for a prefill
    num_output_tokens: int = 0
    # a peer move of an n > 1 request (kv_transfer/group.py): prompt_token_ids is the prompt, each
    # sample in `samples` goes on from its `moved` output; the blocks are the group's transfer
    # table (num_blocks of them), whose first num_shared_blocks every sample holds
    moved: list[MovedOutput] = []
    num_shared_blocks: int = 0


class Accept(msgspec.Struct, tag="accept", frozen=True):
    request_id: str
    layout: KVLayout
    first_block: int                # blocks before it are prefix hits on D: they do not move
    dst_block_ids: list[int]        # D's block for each of blocks first_block.. of the table
    shm: bool = False               # D shares P's host: frames may name P's shared-memory ring
    reads_cache: bool = False       # D opened the Offer's cache_source: it reads the blocks itself


class Refuse(msgspec.Struct, tag="refuse", frozen=True):
    request_id: str
    reason: str


class BlockFrame(msgspec.Struct, tag="blocks", frozen=True):
    request_id: str
    seq_no: int                     # 0, 1, 2... per request, any order: a repeat fails it
    layer_start: int
    layer_end: int
    block_start: int                # index in the sequence's block table
    src_block_ids: list[int]        # P's ids (for P's logs)
    dst_block_ids: list[int]        # D's ids, as D's Accept mapped them
    dtype: str
    shape: list[int]
    checksum: bytes
    segment: str = ""               # the payload is in this shared-memory ring (kv_transfer/shm.py),
    segment_offset: int = 0         # at this offset, not in a second ZMQ frame; D then marks the
    segment_end: int = 0            # ring consumed up to segment_end


class Done(msgspec.Struct, tag="done", frozen=True):
    request_id: str
    num_frames: int
    samples: list[SampleStart] = []     # a streamed Offer's first tokens (it had none)
    src_block_ids: list[int] = []       # reads_cache: P's blocks [first_block, num_blocks) to read
    hold_until: float = 0.0             # reads_cache: P keeps them until this time.monotonic() of
                                        # the host (one clock: D shares P's boot), then may reuse them
    last_hidden: LastHidden | None = None   # method mtp: the MTP layer's first input (LastHidden)


class Ack(msgspec.Struct, tag="ack", frozen=True):
    request_id: str


class Fail(msgspec.Struct, tag="fail", frozen=True):
    request_id: str
    reason: str


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_id: str


class NixlSource(msgspec.Struct, tag="nixl_source", frozen=True):
    peer: bytes                     # nixl_transport.NixlPeer, msgpack (bounded by MAX_HEADER_BYTES)


Message = Offer | Accept | Refuse | BlockFrame | Done | Ack | Fail | Abort | NixlSource

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises ValueError on anything that is not one well-formed message of bounded size."""
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"malformed message: {e}") from None


def checksum(payload: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)
