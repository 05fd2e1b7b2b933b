"""ModelRunner: owns the model's tensors (weights, KV cache) and runs one forward per step.

The engine hands it a ForwardBatch and gets float32 logits back for `batch.logits_indices`.
`forward` is three separate pieces so that CUDA graph capture (gpu_worker/cuda_graphs.py) can
replay just the middle one on static buffers:

    prepare_inputs(batch) -> ForwardBatch on the device   (host -> device copies)
    run_model(batch)      -> hidden (T, H)                (pure device work: graph-capturable)
    compute_logits(hidden, logits_indices) -> (S, V) fp32
"""
from __future__ import annotations

import dataclasses

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.loader import check_checkpoint, load_weights
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.decoder import CausalLM, KVCache

# CPU has no device memory to profile: without num_gpu_blocks the KV cache gets this much.
CPU_KV_BUDGET_BYTES = 2 * 1024**3
# Tokens of the dummy forward that measures peak activation memory in profile_num_blocks.
PROFILE_TOKENS = 4096


def make_attention_backend(name: str, device: torch.device, cfg: ModelConfig) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from gpu_worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(sliding_window=cfg.sliding_window)
    if name == "triton":
        from gpu_worker.attention.triton_backend import TritonAttentionBackend  # lazy: needs triton
        return TritonAttentionBackend(sliding_window=cfg.sliding_window)
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, torch or triton")


class ModelRunner:
    def __init__(self, config: ModelConfig, model_dir: str, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, attention_backend: str = "torch", seed: int = 0):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        torch.manual_seed(seed)
        self.attention = make_attention_backend(attention_backend, self.device, config)
        # Build on the meta device (no memory, no random init), then allocate for real and load.
        with torch.device("meta"):
            model = CausalLM(config, self.attention, dtype)
        check_checkpoint(model_dir, set(model.hf_weight_targets()))  # fail before allocating
        self.model = model.to_empty(device=self.device).eval()
        self.model.rope.build_cache(self.device)
        load_weights(self.model, model_dir)
        self.kv_caches: list[KVCache] = []
        self.block_size = 0
        self.decode_graphs = None   # gpu_worker.cuda_graphs.DecodeGraphs once captured

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_blocks(self) -> int:
        return int(self.kv_caches[0][0].shape[0]) if self.kv_caches else 0

    def block_size_bytes(self, block_size: int) -> int:
        """Bytes of K and V for one block across all layers."""
        cfg = self.config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        return block_size * per_token

    # ---- KV cache ----------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Per layer, K and V of shape (num_blocks, block_size, n_kv, head_dim), zeroed."""
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = []  # free the old cache first
        self.decode_graphs = None  # captured graphs point at the old cache
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]
        self.block_size = block_size

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write for forked samples)."""
        if not src:
            return
        if len(src) != len(dst):
            raise ValueError("copy_blocks: src and dst must have the same length")
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, d, k_cache.index_select(0, s))
            v_cache.index_copy_(0, d, v_cache.index_select(0, s))

    def profile_num_blocks(self, block_size: int, gpu_memory_utilization: float,
                           max_num_batched_tokens: int = PROFILE_TOKENS) -> int:
        """How many KV blocks fit. CUDA: run a dummy forward of `max_num_batched_tokens` tokens,
        then give the KV cache what is left of `gpu_memory_utilization` x total memory. CPU: there
        is nothing to profile; returns the blocks of a CPU_KV_BUDGET_BYTES cache (callers on CPU
        should pass num_gpu_blocks instead)."""
        per_block = self.block_size_bytes(block_size)
        if self.device.type != "cuda":
            return max(1, CPU_KV_BUDGET_BYTES // per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_forward(max_num_batched_tokens, block_size)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory other processes (and non-torch allocations) hold counts against us too.
        other = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * gpu_memory_utilization) - peak - max(other, 0)
        torch.cuda.empty_cache()
        if budget < per_block:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: weights and activations need {peak / 2**30:.1f} "
                f"GiB of the {total * gpu_memory_utilization / 2**30:.1f} GiB allowed; raise "
                "gpu_memory_utilization or lower max_num_batched_tokens")
        return budget // per_block

    def _dummy_forward(self, num_tokens: int, block_size: int) -> None:
        num_tokens = max(1, min(num_tokens, self.config.max_position_embeddings))
        n_blocks = -(-num_tokens // block_size)
        saved, saved_bs = self.kv_caches, self.block_size
        self.allocate_kv_cache(n_blocks, block_size)
        i32 = dict(dtype=torch.int32, device=self.device)
        batch = ForwardBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            positions=torch.arange(num_tokens, device=self.device),
            query_lens=torch.tensor([num_tokens], **i32), context_lens=torch.tensor([num_tokens], **i32),
            query_start_loc=torch.tensor([0, num_tokens], **i32),
            block_tables=torch.arange(n_blocks, **i32)[None],
            slot_mapping=torch.arange(num_tokens, device=self.device),
            logits_indices=torch.tensor([num_tokens - 1], device=self.device),
            max_query_len=num_tokens, max_context_len=num_tokens)
        self.forward(batch)
        self.kv_caches, self.block_size = saved, saved_bs

    # ---- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> (S, vocab) float32 logits for the rows `batch.logits_indices`."""
        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before forward")
        batch = self.prepare_inputs(batch)
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(batch):
            hidden = graphs.run(batch)                        # (B, H), replayed graph
        else:
            hidden = self.run_model(batch)                    # (T, H)
        return self.compute_logits(hidden, batch.logits_indices)

    def capture_cuda_graphs(self, max_batch_size: int, max_context_len: int) -> None:
        """Capture decode steps of up to `max_batch_size` sequences (after allocate_kv_cache);
        forward then replays them for pure-decode batches. On CPU the same path runs eagerly."""
        from gpu_worker.cuda_graphs import DecodeGraphs

        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache must be called before capture_cuda_graphs")
        if self.device.type == "cuda" and self.attention.name == "torch":
            raise ValueError("CUDA graphs need attention_backend='triton': the torch reference "
                             "backend reads lengths on the host, which graph capture forbids")
        self.decode_graphs = None
        graphs = DecodeGraphs(self.run_model, device=self.device, max_batch_size=max_batch_size,
                              max_blocks_per_seq=-(-max_context_len // self.block_size),
                              max_context_len=max_context_len)
        graphs.capture()
        self.decode_graphs = graphs

    def prepare_inputs(self, batch: ForwardBatch) -> ForwardBatch:
        """Move every tensor of the batch to the model's device (non-blocking from pinned memory)."""
        moved = {}
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor) and value.device != self.device:
                value = value.to(self.device, non_blocking=True)
            moved[f.name] = value
        return ForwardBatch(**moved)

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """The graph-capturable part: (T,) ids -> (T, H) final hidden states."""
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """(T, H) hidden, (S,) row indices -> (S, V) float32."""
        return self.model.compute_logits(hidden[logits_indices])
