"""Document-aware block geometry of the CP attention, and the loops that run a block's pieces.

Packed rows follow transformers' convention: ``position_ids`` count 0, 1, 2, … inside each
document and restart at 0 where the next document starts. So the document of the token at global
index ``i`` starts at ``i − position_ids[i]`` (clamped to [0, i]) and the attention mask is

    key j is visible to query i  ⇔  lo(i) <= j <= i,   lo(i) = max(i − position_ids[i], i − W + 1)

which needs only the *query's* own position: every rank derives its mask from the positions of
the tokens it holds, with no communication. ``W`` is the layer's sliding window (none: ``lo`` is
the document start). A chunked-attention layer (Llama 4: ``attention_chunk_size`` C) restarts
every C positions of a document as if a document started there. A row without restarts is plain causal
attention.

Queries of one chunk are cut into *runs* of equal document start. Against a key span, each run
sees one contiguous range of keys, so a block becomes a few rectangles (``Rect``): dense ones
(keys entirely before the run), one causal square (the run's own tokens), and under a sliding
window, past the first W tokens of a document, tiles of W queries each seeing a dense rectangle,
a causal square and an *anti-causal* square (the window's lower edge: key j visible iff
j − k0 >= i − q0, computed as a causal square on the reversed sequences). A block whose keys lie
wholly outside every query's range gets no rectangle and is skipped; no S×S (or Lq×Lk) mask is
ever built. Rows of a batch with the same rectangles are computed together; rows that differ are
computed in groups (``Groups``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ndparallel.parallel.cp.attention_kernels import BlockKernel, merge_


class Rect(NamedTuple):
    """Queries [q0, q1) of a chunk against keys [k0, k1) of a key span. ``causal``: a diagonal
    square, key j visible to query i iff j − k0 <= i − q0; ``anti``: a square whose key j is
    visible iff j − k0 >= i − q0 (a sliding window's lower edge); neither: dense."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    anti: bool = False


Groups = list  # [(rows: LongTensor | None for all rows, rects: tuple[Rect, ...])]


def document_starts(
    position_ids: torch.Tensor | None, global_index: torch.Tensor, batch: int, chunk: int | None = None
):
    """Global index of the start of each token's document, ``[batch, len]`` int64 on the CPU
    (one host copy), or None when there are no position ids and no ``chunk`` (plain causal).
    ``chunk``: chunked attention also restarts every ``chunk`` positions of a document (as
    transformers' chunked mask on packed rows: chunks are counted in ``position_ids``)."""
    idx = global_index.to("cpu", torch.int64)
    if position_ids is None:
        return None if chunk is None else (idx - idx % chunk).expand(batch, -1).contiguous()
    pos = position_ids.expand(batch, -1).to("cpu", torch.int64)
    idx = idx.expand_as(pos)
    starts = torch.minimum((idx - pos).clamp_(min=0), idx)
    return starts if chunk is None else torch.maximum(starts, idx - pos % chunk)


class DocLayout:
    """Rectangles of every block of this rank's queries (local chunks ``chunk_ids`` of ``n``
    tokens) against any key span, computed once per attention call and kept for backward.
    ``window``: the layer's sliding window W (query i sees at most keys i−W+1 .. i)."""

    def __init__(
        self,
        starts: torch.Tensor | None,
        chunk_ids: Sequence[int],
        n: int,
        batch: int,
        device: torch.device,
        window: int | None = None,
    ):
        if window is not None and window < 1:
            raise ValueError(f"sliding window {window} must be >= 1")
        self.chunk_ids, self.n, self.batch, self.device = tuple(chunk_ids), n, batch, device
        self.window = window
        self._runs = [self._chunk_runs(starts, j, c) for j, c in enumerate(self.chunk_ids)]
        self._cache: dict = {}

    def _chunk_runs(self, starts, j: int, c: int):
        """Per row: ((t0, t1, document start), ...) maximal runs of equal start in local chunk j."""
        n = self.n
        if starts is None:
            return [((0, n, 0),)] * self.batch
        st = starts[:, j * n : (j + 1) * n]
        change = torch.ones_like(st, dtype=torch.bool)
        change[:, 1:] = st[:, 1:] != st[:, :-1]
        out = []
        for b in range(self.batch):
            cuts = change[b].nonzero().flatten().tolist() + [n]
            out.append(tuple((t0, t1, int(st[b, t0])) for t0, t1 in zip(cuts[:-1], cuts[1:])))
        return out

    def groups(self, qi: int, k_start: int, k_len: int) -> Groups:
        """Rectangles of local query chunk ``qi`` against global keys [k_start, k_start+k_len),
        grouped by rows with equal rectangles; [] when no query sees any of these keys."""
        key = (qi, k_start, k_len)
        if key not in self._cache:
            q_start = self.chunk_ids[qi] * self.n
            by_rects: dict = {}
            for b, runs in enumerate(self._runs[qi]):
                rects = tuple(
                    r for run in runs for r in _run_rects(run, q_start, self.n, k_start, k_len, self.window)
                )
                by_rects.setdefault(rects, []).append(b)
            self._cache[key] = [
                (None if len(rows) == self.batch else torch.tensor(rows, device=self.device), rects)
                for rects, rows in by_rects.items()
                if rects
            ]
        return self._cache[key]


_DENSE, _CAUSAL, _ANTI = 0, 1, 2


def _run_pieces(g0: int, g1: int, s: int, window: int | None) -> list[tuple]:
    """Pieces (q0, q1, k0, k1, kind) in global indices of queries [g0, g1) whose document starts
    at ``s``: queries within W of the start see [s, i] (a dense part + a causal square); later ones
    see [i−W+1, i], cut into tiles of at most W queries (anti-causal square, dense, causal)."""
    edge = g1 if window is None else min(g1, max(g0, s + window))
    pieces = []
    if g0 < edge:
        if s < g0:
            pieces.append((g0, edge, s, g0, _DENSE))
        pieces.append((g0, edge, g0, edge, _CAUSAL))
    a = edge
    while a < g1:
        b = min(a + window, g1)
        if b - a > 1:  # queries a .. b-2 see keys a−W+1+u .. ; query b−1 sees none of them
            pieces.append((a, b - 1, a - window + 1, b - window, _ANTI))
        if b - window < a:
            pieces.append((a, b, b - window, a, _DENSE))
        pieces.append((a, b, a, b, _CAUSAL))
        a = b
    return pieces


def _clip(piece: tuple, k0: int, k1: int) -> list[tuple]:
    """A piece restricted to the keys [k0, k1) of a span (an anti-causal square cut by the span's
    edges becomes smaller anti-causal squares and a dense rectangle)."""
    q0, q1, c0, c1, kind = piece
    if c1 <= k0 or c0 >= k1 or c0 >= c1:
        return []
    if kind == _DENSE:
        return [(q0, q1, max(c0, k0), min(c1, k1), kind)]
    if kind == _CAUSAL:
        if c0 < k0 or c1 > k1:
            raise ValueError(f"key span [{k0}, {k1}) partly overlaps query chunk [{c0}, {c1})")
        return [piece]
    if c0 < k0:  # keys before the span dropped: the queries above the cut see all the rest
        cut = k0 - c0
        return _clip((q0, q0 + cut, k0, c1, _DENSE), k0, k1) + _clip((q0 + cut, q1, k0, c1, _ANTI), k0, k1)
    if c1 > k1:  # keys after the span dropped: later queries see none of the kept ones
        cut = k1 - c0
        return [(q0, q0 + cut, c0, k1, _ANTI)]
    return [piece]


def _run_rects(run, q_start: int, n: int, k_start: int, k_len: int, window: int | None = None):
    """Rectangles of one run (t0, t1, doc start s) of the chunk at ``q_start`` against a key span
    that lies wholly before the chunk, or is the chunk itself (diagonal), or is all keys up to the
    chunk's end."""
    t0, t1, s = run
    if k_start >= q_start + n:  # keys after the chunk: causally invisible
        return []
    rects = []
    for piece in _run_pieces(q_start + t0, q_start + t1, s, window):
        for q0, q1, c0, c1, kind in _clip(piece, k_start, k_start + k_len):
            rects.append(
                Rect(q0 - q_start, q1 - q_start, c0 - k_start, c1 - k_start, kind == _CAUSAL, kind == _ANTI)
            )
    return rects


# ------------------------------------------------------------------------ the loops
def _take(t: torch.Tensor, rows, lo: int, hi: int) -> torch.Tensor:
    t = t[:, :, lo:hi]
    return t if rows is None else t.index_select(0, rows)


def forward_span(kernel: BlockKernel, q, k, v, acc_out, acc_lse, groups: Groups, fresh: bool) -> bool:
    """Attend the chunk's queries ``q`` [B, H, n, D] to a key span ``k``/``v`` along ``groups``,
    merging into ``acc_out`` (fp32) / ``acc_lse`` (views of this chunk's running result) in place.
    ``fresh``: nothing merged into this chunk yet (a single whole-chunk rectangle is then stored,
    not merged). Returns whether the chunk is still fresh."""
    for rows, rects in groups:
        for r in rects:
            out, lse = kernel.fwd(
                _take(q, rows, r.q0, r.q1),
                _take(k, rows, r.k0, r.k1),
                _take(v, rows, r.k0, r.k1),
                r.causal,
                r.anti,
            )
            ao, al = acc_out[:, :, r.q0 : r.q1], acc_lse[:, :, r.q0 : r.q1]
            if rows is None and fresh and (r.q0, r.q1) == (0, q.shape[2]):
                ao.copy_(out)
                al.copy_(lse)
            elif rows is None:
                merge_(ao, al, out, lse)
            else:
                sub_o, sub_l = ao.index_select(0, rows), al.index_select(0, rows)
                merge_(sub_o, sub_l, out, lse)
                ao.index_copy_(0, rows, sub_o)
                al.index_copy_(0, rows, sub_l)
            fresh = False
    return fresh


def backward_span(kernel: BlockKernel, q, k, v, out, dout, lse, dq, dk, dv, groups: Groups) -> None:
    """Gradients of the chunk's blocks against one key span, added into the fp32 views ``dq``
    (this chunk), ``dk``/``dv`` (this key span)."""
    for rows, rects in groups:
        for r in rects:
            g_q, g_k, g_v = kernel.bwd(
                _take(dout, rows, r.q0, r.q1),
                _take(q, rows, r.q0, r.q1),
                _take(k, rows, r.k0, r.k1),
                _take(v, rows, r.k0, r.k1),
                _take(out, rows, r.q0, r.q1),
                _take(lse, rows, r.q0, r.q1),
                r.causal,
                r.anti,
            )
            if rows is None:
                dq[:, :, r.q0 : r.q1].add_(g_q)
                dk[:, :, r.k0 : r.k1].add_(g_k)
                dv[:, :, r.k0 : r.k1].add_(g_v)
            else:
                dq[:, :, r.q0 : r.q1].index_add_(0, rows, g_q.to(dq.dtype))
                dk[:, :, r.k0 : r.k1].index_add_(0, rows, g_k.to(dk.dtype))
                dv[:, :, r.k0 : r.k1].index_add_(0, rows, g_v.to(dv.dtype))


def accumulators(q: torch.Tensor):
    """Running (out fp32 zeros, lse -inf) of the queries ``q`` [B, H, S, D]."""
    return (
        torch.zeros(q.shape, dtype=torch.float32, device=q.device),
        torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device),
    )


class _LocalAttention(torch.autograd.Function):
    """All queries against all keys of one sequence on one rank (no CP, or after Ulysses'
    all-to-all), document-masked.

    When every rectangle is a causal square (each document of each row is its own block: the
    usual packed row), the squares partition the queries and the keys, so each block's output and
    gradients are written straight into the results, in the inputs' dtype: no fp32 accumulator of
    the whole sequence, the scratch is one block's. Otherwise (a run that continues a document
    from before the row start) blocks of the same queries are merged in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: BlockKernel, docs: DocLayout):
        groups = docs.groups(0, 0, q.shape[2])
        direct = _squares_only(groups)
        if direct:
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            for rows, rects in groups:
                for r in rects:
                    o, l_ = kernel.fwd(
                        _take(q, rows, r.q0, r.q1),
                        _take(k, rows, r.k0, r.k1),
                        _take(v, rows, r.k0, r.k1),
                        True,
                    )
                    _put(out, rows, r.q0, r.q1, o)
                    _put(lse, rows, r.q0, r.q1, l_)
        else:
            acc_out, lse = accumulators(q)
            forward_span(kernel, q, k, v, acc_out, lse, groups, True)
            out = acc_out.to(q.dtype)
            del acc_out
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, docs, direct)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, docs, direct = ctx.args
        dout = dout.contiguous()
        groups = docs.groups(0, 0, q.shape[2])
        if direct:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            for rows, rects in groups:
                for r in rects:
                    g_q, g_k, g_v = kernel.bwd(
                        _take(dout, rows, r.q0, r.q1),
                        _take(q, rows, r.q0, r.q1),
                        _take(k, rows, r.k0, r.k1),
                        _take(v, rows, r.k0, r.k1),
                        _take(out, rows, r.q0, r.q1),
                        _take(lse, rows, r.q0, r.q1),
                        True,
                    )
                    _put(dq, rows, r.q0, r.q1, g_q)
                    _put(dk, rows, r.k0, r.k1, g_k)
                    _put(dv, rows, r.k0, r.k1, g_v)
            return dq, dk, dv, None, None
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        backward_span(kernel, q, k, v, out, dout, lse, dq, dk, dv, groups)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _squares_only(groups: Groups) -> bool:
    """Every rectangle a causal square: they partition the queries and the keys of each row."""
    return all(r.causal for _, rects in groups for r in rects)


def _put(dst: torch.Tensor, rows, lo: int, hi: int, src: torch.Tensor) -> None:
    """dst[rows, :, lo:hi] = src (all rows when ``rows`` is None), cast to dst's dtype."""
    view = dst[:, :, lo:hi]
    if rows is None:
        view.copy_(src)
    else:
        view.index_copy_(0, rows, src.to(dst.dtype))


def local_attention(q, k, v, kernel: BlockKernel, docs: DocLayout) -> torch.Tensor:
    """Document-masked causal attention of one whole sequence on this rank (autograd)."""
    return _LocalAttention.apply(q, k, v, kernel, docs)


class DocCache:
    """The ``DocLayout``s built for the last position-ids tensor (keyed on its identity, version
    counter, storage and shape), one per call layout (``extra``: e.g. sliding-window and full
    layers): the layers of one forward (and its recomputation under activation checkpointing)
    share one host copy of the positions. A new batch (another tensor, or the same one re-pointed
    or written in place) starts afresh."""

    def __init__(self):
        self._ref, self._key, self._values = None, None, {}

    def get(self, position_ids: torch.Tensor | None, extra: tuple, build):
        if position_ids is None:
            return build()
        key = (position_ids._version, position_ids.data_ptr(), tuple(position_ids.shape))
        if self._ref is None or self._ref() is not position_ids or self._key != key:
            self._ref, self._key, self._values = weakref.ref(position_ids), key, {}
        if extra not in self._values:
            self._values[extra] = build()
        return self._values[extra]
