"""CUDA graphs of the engine's forwards: one graph per bucket, recorded once and replayed.

At batch 1 on a GPU a small model's decoding step is bound by kernel launches, not by the GPU:
an eager transformers forward issues some fifteen kernels per layer from Python, and the GPU
waits for each. A CUDA graph records a forward's kernels once and replays them with a single
launch (as gpt-fast and vLLM do).

Terms
-----
bucket
    what one recorded graph is fixed to, its key: the kind of call, the caches it writes (their
    storage addresses and shapes, :func:`cache_key`), and the shapes and Python values its
    inputs are built from. The engine's decoding step is keyed by (rows in use B, tree size T,
    feature layers): plain steps are T = 1, and each tree size the proposer or the policy picks
    is its own bucket. The EAGLE proposer records its drafter passes the same way (catch-ups
    of the committed tokens, tree expansions). A bucket is recorded the first time it is met
    (one eager warm-up call, then the capture) and replayed after that. With graphs, batches
    take their KV storage from a :class:`~distill.engine.cache.SlotPool`, so a later request
    of a fitting size meets the buckets an earlier one recorded.
static window
    a graphed forward attends over all of its cache's slots, not over the longest row's
    ``end + T`` (the window of an eager step), so that its shapes do not grow with the
    sequences. The attention bias hides the unused slots exactly as it hides another row's
    slots: their weights are exp(min - max) = 0, and the outputs are those of the eager call.
static inputs
    a bucket's input tensors live in buffers the graph reads; each call copies its values into
    them before the replay. The graph's outputs are copied out after it, so a later replay
    never changes what a caller holds.

Only the forwards are recorded; what surrounds them (proposal bookkeeping, masks, acceptance,
compaction, the host transfer) stays eager. Prefills are not graphed (their length varies with
the prompts).

:class:`Graphs` also runs without capturing (``capture=False``): the same calls with the same
static windows, run eagerly, which is how the bucket logic is tested on a CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distill.engine import cache as kv

#: buckets kept per engine (least recently used dropped first): batch sizes 1..8 by a few tree sizes, and the drafter's
MAX_BUCKETS = 96


def cache_key(cache: kv.SlotCache) -> tuple:
    """What a graph that writes ``cache`` is tied to: its storage (addresses, shapes) and the rows in use."""
    return (cache.keys.data_ptr(), cache.values.data_ptr(), tuple(cache.keys.shape), tuple(cache.values.shape), cache.rows)


@dataclass
class _Bucket:
    inputs: tuple[torch.Tensor, ...]  # the static inputs
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, ...] = ()  # the graph's static outputs


class Graphs:
    """Calls recorded as CUDA graphs, one per bucket (see the module docstring).

    ``capture``: record CUDA graphs (a CUDA device); False runs every call eagerly (any device)
    and only counts its buckets.
    """

    def __init__(self, capture: bool, max_buckets: int = MAX_BUCKETS):
        self.capture = capture
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[tuple, _Bucket] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for all buckets
        self.recorded = 0  # buckets recorded (captures)
        self.replays = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def keys(self) -> list[tuple]:
        return list(self._buckets)

    def __call__(self, key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``fn(*inputs)`` -> its output tensors (copies), replayed from the bucket ``key``.

        ``fn`` may read only its inputs, the weights and the storage of the caches named in
        ``key``, with no host synchronisation; everything else its kernels depend on (shapes,
        Python values) must be in ``key``.
        """
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = _Bucket(tuple(x.clone() for x in inputs) if self.capture else ())  # eager: nothing to keep
            self._buckets[key] = bucket
            while len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
            if not self.capture:
                return fn(*inputs)
            self._record(bucket, fn)
        else:
            self._buckets.move_to_end(key)
            if not self.capture:
                return fn(*inputs)
            for static, x in zip(bucket.inputs, inputs):
                static.copy_(x)
        bucket.graph.replay()
        self.replays += 1
        return tuple(x.clone() for x in bucket.outputs)

    def _record(self, bucket: _Bucket, fn) -> None:
        """Warm up on a side stream (lazy library set-up stays out of the graph), then capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*bucket.inputs)  # writes the caches as the replay after the capture will
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.outputs = tuple(fn(*bucket.inputs))
        bucket.graph = graph
        self.recorded += 1


__all__ = ["MAX_BUCKETS", "Graphs", "cache_key"]
