"""CUDA graphs for decode steps: capture the model forward once per batch-size bucket, replay it.

A decode step runs one token per sequence, so its shapes depend only on the batch size. Like
vLLM's and nano-vllm's graph runners, :class:`CUDAGraphRunner` keeps static input buffers
(``input_ids``, ``positions``, ``slot_mapping``, ``block_tables``, ``context_lens``) sized for
the largest bucket, captures the decoder forward (embedding .. final norm; not the LM head,
whose gather to rank 0 stays eager) for every bucket into one shared memory pool, and for a
batch of ``B`` sequences copies the step's inputs into the buffers and replays the smallest
bucket ``>= B``. Padding slots get slot -1 (nothing stored) and context length 0 (attention
output zero), which the Triton kernels handle; their hidden rows are ignored.

Only a backend with ``graph_safe`` (Triton) can be captured: its ``prepare`` for a decode step does not
sync with the host, so the whole step -- ``backend.prepare`` and ``model.model(input_ids, positions, ctx)``
-- is captured (the CPU backend reads lengths on the host).
At tp > 1 every rank replays the same bucket in lockstep, so the captured NCCL all-reduces
match. With ``use_graphs=False`` the same buffers and padding run eagerly (CPU tests).
"""

from __future__ import annotations

import torch

from tpengine.context import Context

#: larger decode batches run eagerly
MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets for up to ``max_num_seqs`` sequences: 1, 2, 4, 8, then every 16, then
    ``max_num_seqs`` itself (nano-vllm's choice), ascending."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class CUDAGraphRunner:
    """Captured decode forwards for ``model`` (a loaded tpengine HF model whose attention
    modules already hold their KV caches).

    Args:
        model: the causal LM; ``model.model(input_ids [N], positions [N], ctx) -> [N, hidden]`` is run.
        backend: the engine's attention backend (must be graph-safe, i.e. Triton, to capture).
        max_num_seqs: largest decode batch (captured up to :data:`MAX_GRAPH_BATCH`).
        max_blocks: block-table width of the buffers (``ceil(max_model_len / block_size)``);
            the decode kernel's split count depends on it, so it is fixed at capture.
        hidden_size, dtype, device: of the decoder's output.
        use_graphs: capture and replay CUDA graphs (CUDA only); False runs the padded static
            buffers eagerly, which is what the CPU tests exercise.
    """

    def __init__(self, model, backend, max_num_seqs: int, max_blocks: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, use_graphs: bool = True):
        self.model, self.backend, self.max_blocks = model, backend, max_blocks
        self.use_graphs = use_graphs
        self.batch_sizes = graph_batch_sizes(min(max_num_seqs, MAX_GRAPH_BATCH))
        n = self.batch_sizes[-1]
        i64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.context_lens = torch.zeros(n, **i64)
        self.block_tables = torch.full((n, max_blocks), -1, **i64)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _forward(self, bs: int) -> None:
        """The decoder on the first ``bs`` buffer rows, written into ``hidden[:bs]``."""
        ctx = Context.build(self.backend, False, self.slot_mapping[:bs], self.block_tables[:bs],
                            context_lens=self.context_lens[:bs])
        self.hidden[:bs] = self.model.model(self.input_ids[:bs], self.positions[:bs], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool. Each is run eagerly once
        first (Triton compilation, cuBLAS and NCCL set-up happen outside the capture). The
        buffers hold padding (slot -1, context 0), so neither run touches the KV cache."""
        if not self.use_graphs:
            return
        for bs in reversed(self.batch_sizes):
            self._forward(bs)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()

    def can_run(self, num_seqs: int, table_width: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences whose block tables are ``table_width``
        blocks wide fits the largest bucket and the buffers' block-table width."""
        return 0 < num_seqs <= self.batch_sizes[-1] and table_width <= self.max_blocks

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            context_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Run one decode step (``can_run`` true) of B sequences: ``input_ids``, ``positions``,
        ``slot_mapping``, ``context_lens`` ``[B]`` and ``block_tables`` ``[B, M]`` (int32 / int64 on
        the device, as a decode ``StepPlan`` holds them) are copied into the static buffers and the
        smallest bucket ``>= B`` replays. Returns ``[B, hidden]``, a view of the static output valid
        until the next run."""
        b, m = block_tables.shape
        bs = next(s for s in self.batch_sizes if s >= b)
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
        self.context_lens[:b].copy_(context_lens, non_blocking=True)
        self.block_tables[:b, :m].copy_(block_tables, non_blocking=True)
        self.block_tables[:b, m:].fill_(-1)
        self.slot_mapping[b:bs].fill_(-1)  # padding rows: store nothing, attend to nothing
        self.context_lens[b:bs].zero_()
        if self.use_graphs:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.hidden[:b]
