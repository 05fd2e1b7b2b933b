"""Loads that a step's forward scatters layer by layer, so a prompt's prefill starts while the
last layers of its history are still copying from host memory.

    load stream   H2D group 0 -> ev0 | H2D group 1 -> ev1 | ...           (stage(), at admission)
    step stream   gather(evicted) | embed | wait ev0, scatter layer 0, layer 0 | scatter layer 1,
                  layer 1 | ... | wait ev1, scatter layer g, layer g | ...  (this step's forward)

Layer i's blocks are written before layer i runs and never read before (a layer reads only its
own KV cache), so the forward is exact however far the copy has got. Off CUDA the copies are done
at admission and the same scatters run, layer by layer, inside the forward.
"""
from __future__ import annotations

from gpu_worker.kv_tiers.block_mover import BlockMover
from gpu_worker.kv_tiers.manager import PendingLoad


class LayerLoads:
    def __init__(self, mover: BlockMover, loads: list[PendingLoad]) -> None:
        self.mover = mover
        self.loads = loads
        self.block_ids = [mover.block_index(load.block_ids) for load in loads]   # uploaded once
        self.num_layers = mover.block_shape[0]
        self.next_layer = 0               # layers below it are scattered (queued on the step stream)

    def before_layer(self, layer: int) -> None:
        """Scatter every load's blocks of the layers up to `layer` not scattered yet."""
        while self.next_layer <= min(layer, self.num_layers - 1):
            for load, block_ids in zip(self.loads, self.block_ids):
                self.mover.scatter_layer(load.staged, block_ids, self.next_layer)
            self.next_layer += 1

    def finish(self) -> None:
        """Scatter what is left: before a forward that has no per-layer hook (a whole-step CUDA
        graph) and after every forward, so no step ends with a load half written."""
        self.before_layer(self.num_layers - 1)
