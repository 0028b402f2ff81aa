"""Rendered samples -> ``input_ids`` and ``labels`` (the token id where trained, -100 elsewhere).

A prompt and its answer (``Rendered.separately``: alpaca, jeopardy, custom formats) are tokenised
apart, as Axolotl does and as inference sees them (the prompt alone is tokenised, then the model
writes): no token straddles the boundary (Llama 3's ``:\n\n``), the answer's tokens are trained.
Other samples (chat templates, segments) are tokenised once, whole, with offsets: a token is
trained when one of its characters lies in a trained segment (so a token that joins a header's
space to the answer's first word, as `` the`` after Jamba's ``<|assistant|>``, is learned with the
answer). Tokens the tokenizer adds itself (a BOS) are not trained; an appended eos is trained
when the last segment is. ``train_on_inputs`` trains every token (of a chat: every turn, as
Axolotl, by ``chat.ChatRenderer``; the role headers stay untrained). ``labels`` are per token, not
shifted (Axolotl's convention); the rows built from them hold the shifted ones.

``tokenize_samples`` maps a dataset of records through this (batched ``datasets.map``), cached in
``cache_dir/sft/<key>.arrow``, the key hashing the dataset's fingerprint, the tokenizer and every
setting that changes the result; under a file lock (one rank writes, the others load). The key is
also the result's fingerprint, so the rows built from it are cached under a stable name.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from typing import Any

import datasets

from ndparallel.data.chat import ChatRenderer, resolve_template
from ndparallel.data.chat_check import chat_problem
from ndparallel.techniques.loss import IGNORE_INDEX

from .dataset import DatasetSpec, cached_map, tokenizer_hash
from .prompts import Rendered, render

_VERSION = 4  # bump when the encoding changes, to invalidate cached results


def encode(tokenizer, rendered: Rendered, train_on_inputs: bool = False) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one rendered sample."""
    if rendered.separately:
        return _encode_apart(tokenizer, rendered, train_on_inputs)
    text = "".join(t for t, _ in rendered.segments)
    enc = tokenizer(text, add_special_tokens=rendered.add_special_tokens, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    starts, flags, pos = [], [], 0
    for seg_text, trained in rendered.segments:
        if seg_text:
            starts.append(pos)
            flags.append(trained)
            pos += len(seg_text)
    labels = []
    for tok, (a, b) in zip(ids, enc["offset_mapping"]):
        if train_on_inputs:
            labels.append(tok)
            continue
        first, last = bisect.bisect_right(starts, a) - 1, bisect.bisect_right(starts, b - 1) - 1
        labels.append(tok if b > a and last >= 0 and any(flags[max(first, 0) : last + 1]) else IGNORE_INDEX)
    if (
        rendered.append_eos
        and tokenizer.eos_token_id is not None
        and (not ids or ids[-1] != tokenizer.eos_token_id)
    ):
        last = next((f for t, f in reversed(rendered.segments) if t), True)
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id if (last or train_on_inputs) else IGNORE_INDEX)
    return ids, labels


def _encode_apart(tokenizer, rendered: Rendered, train_on_inputs: bool) -> tuple[list[int], list[int]]:
    """Each segment tokenised alone (the first with the tokenizer's special tokens, the others
    without its BOS), then an eos (Axolotl's ``_tokenize`` of the prompt, then of the response)."""
    ids: list[int] = []
    labels: list[int] = []
    bos = tokenizer.bos_token_id
    for text, trained in rendered.segments:
        if not text:
            continue
        part = list(tokenizer(text, add_special_tokens=rendered.add_special_tokens)["input_ids"])
        if ids and part and part[0] == bos:
            part = part[1:]
        first_bos = not ids and part and part[0] == bos and not train_on_inputs
        ids += part
        marks = part if (trained or train_on_inputs) else [IGNORE_INDEX] * len(part)
        labels += [IGNORE_INDEX, *marks[1:]] if first_bos else marks
    eos = tokenizer.eos_token_id
    if rendered.append_eos and eos is not None and (not ids or ids[-1] != eos):
        last = next((f for t, f in reversed(rendered.segments) if t), True)
        ids.append(eos)
        labels.append(eos if (last or train_on_inputs) else IGNORE_INDEX)
    return ids, labels


def _cache_key(records, spec: DatasetSpec, tokenizer, train_on_inputs: bool, chat, template_kwargs) -> str:
    """The key of ``tokenize_samples``' cached rows: every setting that changes them."""
    settings = [
        _VERSION,
        records._fingerprint,
        tokenizer_hash(tokenizer),
        spec.type,
        spec.text_field,
        spec.field_messages,
        spec.message_property_mappings,
        sorted(spec.roles_to_train),
        spec.train_on_eos,
        spec.train_on_eot,
        train_on_inputs,
        chat.template if chat else None,
        chat.turn_tokens if chat else None,
        spec.format,
        spec.drop_system_message,
        spec.field_thinking,
        spec.template_thinking_key,
        spec.roles,
        template_kwargs if chat else None,
    ]
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tokenize_samples(
    records: datasets.Dataset,
    spec: DatasetSpec,
    tokenizer,
    *,
    where: str,
    train_on_inputs: bool = False,
    chat_template: str | None = None,
    eot_tokens: tuple[str, ...] | None = None,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    chat_template_jinja: str | None = None,
    template_kwargs: dict | None = None,
) -> datasets.Dataset:
    """``records`` of ``spec.type`` -> ``{input_ids, labels}`` (one row per record, same order).
    ``chat_template`` / ``chat_template_jinja`` / ``template_kwargs``: the run's, for
    ``chat_template`` datasets that name none."""
    chat = None
    if spec.type == "chat_template":
        if spec.chat_template or spec.chat_template_jinja:
            template = resolve_template(tokenizer, spec.chat_template, spec.chat_template_jinja, where)
        else:
            template = resolve_template(tokenizer, chat_template, chat_template_jinja, where)
        chat = ChatRenderer(tokenizer, template, spec, eot_tokens, template_kwargs, train_on_inputs)

        problem = chat_problem(records, spec, chat.role_names, where)
        if problem:
            raise ValueError(problem)

    def batch_fn(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": []}
        columns = list(batch)
        for row, index in enumerate(indices):
            record = {c: batch[c][row] for c in columns}
            ids, labels = encode(  # a chat's train_on_inputs: every turn trained, by the renderer
                tokenizer,
                render(record, spec, f"{where} row {index}", chat),
                train_on_inputs and chat is None,
            )
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        return out

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "labels": datasets.Sequence(datasets.Value("int32")),
        }
    )
    key = _cache_key(records, spec, tokenizer, train_on_inputs, chat, template_kwargs)
    kwargs: dict[str, Any] = dict(
        batched=True,
        with_indices=True,
        remove_columns=records.column_names,
        features=features,
        num_proc=num_proc,
        desc=f"tokenize {where}",
        new_fingerprint=key,
    )  # our own key: hashing the closure is slow and unstable
    return cached_map(records, batch_fn, cache_dir, "sft", key, **kwargs)
