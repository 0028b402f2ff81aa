"""``pretraining_dataset``: raw text streamed while training, as Axolotl does.

The sources (local files or Hub datasets, ``datasets``' streaming mode: nothing is downloaded or
tokenised ahead) are read record by record; each text is tokenised with an eos appended, and the
tokens are concatenated and cut into blocks of ``sequence_len + 1`` (``input_ids = block[:-1]``,
``shift_labels = block[1:]``). With ``per_document`` (``sample_packing: true``) the positions
restart at each document inside a block and no label crosses a document end, so attention stays
within documents (what Axolotl's multipack attention for pre-training gives).

Every dp rank reads the same stream and takes its rows of each global micro-batch (``dp_size ×
micro_batch_size`` consecutive blocks): the ranks see exactly what one process with the global
micro-batch sees, as with ``PackedLoader``. The cost: every rank reads and tokenises the whole
stream (I/O and tokeniser time × dp ranks; no memory grows with the dataset: one micro-batch of
blocks is held). A stream that ends starts again (the next epoch). Resuming at sample ``n``
re-reads the stream from its start and skips the first ``n`` blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ndparallel.techniques.loss import IGNORE_INDEX

from .dataset import DatasetSpec, _format_of, local_files

_READ = 256  # records tokenised per call


def open_stream(spec: DatasetSpec, where: str):
    """An iterable over the records of one source (``datasets`` streaming mode)."""
    import os

    import datasets

    if "[" in spec.split:
        raise ValueError(
            f"{where}.split: {spec.split!r}: a streamed dataset has no length to slice by; "
            "give a split name (e.g. train) and use skip: N to skip records"
        )
    if os.path.exists(spec.path):
        files, fmt = local_files(spec, where)
        ds = datasets.load_dataset(fmt, data_files={spec.split: files}, split=spec.split, streaming=True)
    elif _format_of(spec.path) is not None or spec.path.startswith((".", "/", "~")):
        raise ValueError(f"{where}.path: {spec.path!r} does not exist")
    else:
        ds = datasets.load_dataset(
            spec.path,
            spec.name,
            split=spec.split,
            streaming=True,
            data_files=list(spec.data_files) if spec.data_files else None,
        )
    return ds.skip(spec.skip) if spec.skip else ds


def check_stream(spec: DatasetSpec, where: str) -> None:
    """The first record of the stream holds the text column (read before any rank starts)."""
    try:
        first = next(iter(open_stream(spec, where)), None)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable source is bad input: one line
        raise ValueError(
            f"{where}.path: {spec.path!r} could not be streamed ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]})"
        ) from None
    if first is None:
        raise ValueError(f"{where}.path: {spec.path!r} holds no record")
    if not isinstance(first.get(spec.text_field), str):
        raise ValueError(
            f"{where}: column {spec.text_field!r} is not a text column of {spec.path!r} (columns: "
            f"{sorted(first)[:10]}); set text_field to the column holding the text"
        )


class TokenStream:
    """Blocks ``[sequence_len + 1]`` (and where documents start) from the sources, epoch after epoch."""

    def __init__(self, specs: list[DatasetSpec], tokenizer, sequence_len: int):
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos token; it is needed to separate streamed documents")
        self.specs, self.tokenizer, self.block = specs, tokenizer, sequence_len + 1

    def _documents(self) -> Iterator[list[int]]:
        eos = self.tokenizer.eos_token_id
        for i, spec in enumerate(self.specs):
            texts: list[str] = []
            for record in open_stream(spec, f"pretraining_dataset[{i}]"):
                text = record.get(spec.text_field)
                if isinstance(text, str) and text:
                    texts.append(text)
                if len(texts) == _READ:
                    yield from self._encode(texts, eos)
                    texts = []
            yield from self._encode(texts, eos)

    def _encode(self, texts: list[str], eos: int) -> Iterator[list[int]]:
        for ids in self.tokenizer(texts)["input_ids"] if texts else []:
            yield ids if ids and ids[-1] == eos else [*ids, eos]

    def blocks(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(tokens, starts)``: int64 ``[block]`` and bool ``[block]`` (True where a document starts)."""
        while True:
            tokens: list[int] = []
            starts: list[bool] = []
            produced = False
            for doc in self._documents():
                tokens += doc
                starts += [True] + [False] * (len(doc) - 1)
                while len(tokens) >= self.block:
                    produced = True
                    yield np.asarray(tokens[: self.block], np.int64), np.asarray(starts[: self.block])
                    del tokens[: self.block], starts[: self.block]
            if not produced:
                raise ValueError(
                    f"pretraining_dataset: the stream gives fewer than sequence_len + 1 = {self.block} "
                    "tokens; lower sequence_len or add data"
                )


def stream_batch(blocks: list[tuple[np.ndarray, np.ndarray]], per_document: bool) -> dict[str, torch.Tensor]:
    """Blocks -> ``input_ids``, ``shift_labels``, ``position_ids`` ``[B, S]``."""
    rows = torch.from_numpy(np.stack([b for b, _ in blocks]))
    starts = torch.from_numpy(np.stack([s for _, s in blocks]))
    s = rows.shape[1] - 1
    labels = rows[:, 1:].clone()
    if not per_document:
        positions = torch.arange(s).expand(rows.shape[0], s).clone()
        return {"input_ids": rows[:, :-1].contiguous(), "shift_labels": labels, "position_ids": positions}
    labels[starts[:, 1:]] = IGNORE_INDEX  # no label crosses a document end
    first = starts[:, :-1].clone()
    first[:, 0] = True  # a block's first token starts its own (piece of a) document
    index = torch.arange(s).expand_as(first)
    last_start = torch.cummax(torch.where(first, index, torch.zeros_like(index)), dim=1).values
    return {
        "input_ids": rows[:, :-1].contiguous(),
        "shift_labels": labels,
        "position_ids": index - last_start,
    }


class StreamingLoader:
    """This dp rank's micro-batches of a ``TokenStream``; ``micro_batch(i)`` is read in order (an
    earlier ``i``, as after a resume, re-reads the stream from its start)."""

    def __init__(
        self,
        stream: TokenStream,
        micro_batch_size: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        length: int,
        per_document: bool = False,
    ):
        self.stream, self.micro_batch_size = stream, micro_batch_size
        self.dp_rank, self.dp_size, self.length, self.per_document = dp_rank, dp_size, length, per_document
        self.global_micro_batch = dp_size * micro_batch_size
        self._blocks: Iterator | None = None
        self._next = 0

    def __len__(self) -> int:
        return self.length

    def micro_batch(self, index: int) -> dict[str, torch.Tensor]:
        if self._blocks is None or index < self._next:
            self._blocks, self._next = self.stream.blocks(), 0
        while True:
            chunk = [next(self._blocks) for _ in range(self.global_micro_batch)]
            self._next += 1
            if self._next - 1 == index:
                mine = chunk[
                    self.dp_rank * self.micro_batch_size : (self.dp_rank + 1) * self.micro_batch_size
                ]
                return stream_batch(mine, self.per_document)

    def token_counts(self, index: int) -> tuple[int, int]:
        """(real, computed) tokens of global micro-batch ``index``: whole blocks, no padding."""
        tokens = self.global_micro_batch * (self.stream.block - 1)
        return tokens, tokens
