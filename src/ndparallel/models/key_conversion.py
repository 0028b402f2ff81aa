"""Checkpoint keys as transformers converts them: its own conversion mapping, applied to a sharded load.

transformers 5 stores some families under other names than their modules (``checkpoint conversion
mapping``, ``transformers.conversion_mapping``): GPT-NeoX's head is ``embed_out`` on disk and
``lm_head`` in the model; MoE families (Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...) keep one tensor
per expert on disk (``experts.3.gate_proj.weight``) and fuse them on load (``experts.gate_up_proj``
[E, 2I, H]). ``from_pretrained`` converts with ``WeightRenaming`` / ``WeightConverter`` transforms
and ``save_pretrained`` reverts them. Here the same transforms, taken from transformers for the
model at hand (``get_model_conversion_mapping``, its ``rename_source_key``, the converters'
operations; no table of our own), serve the sharded load and the export:

* ``checkpoint_keys`` maps the stored keys (from the safetensors headers) onto the model's:
  each model tensor is either one stored tensor (maybe renamed) or the output of a converter over
  several (``Fused``). Shapes of fused tensors are found by running the converter on meta tensors.
* ``Fused.read`` builds the slice of a fused tensor a rank needs. Memory: when the converter stacks
  a list along the fused tensor's first dim (``MergeModulelist(dim=0)`` first, no later operation
  on dim 0: every MoE mapping), only the list entries (experts) inside the slice's rows are read,
  so a rank holds about 3 × its rows × the full inner dims at once (the sources, the stacked and
  the concatenated copy: for FSDP, ≈ 3 × its shard of that one tensor). Any other converter
  builds the whole fused tensor first: ≈ 3 × that one tensor.
* ``SaveConversion`` reverts the conversion while a model is written tensor by tensor (the export
  writes what transformers writes): tensors are held until every member of their conversion
  group has arrived (one tensor for the MoE and GPT-NeoX mappings).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ndparallel.models.adapters import checkpoint_key, is_adapter_param
from ndparallel.models.checkpoint_formats import extra_transforms, keeps_rows


def _transforms(model: nn.Module, add_legacy: bool = True) -> list:
    """transformers' load-time transforms for ``model`` (empty for a non-transformers module).
    transformers looks some up by class name (GPT-NeoX's): an FSDP2-wrapped model (class
    ``FSDP<name>``) is looked up through a meta-device copy of its own class."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    if not isinstance(model, PreTrainedModel):
        return []
    if isinstance(model, FSDPModule):
        cls = next(
            c
            for c in type(model).__mro__[1:]
            if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule)
        )
        with torch.device("meta"):
            model = cls(copy.deepcopy(model.config))
    return get_model_conversion_mapping(model, add_legacy=add_legacy)


@dataclass
class Fused:
    """A model tensor built by a transformers converter from several stored tensors."""

    converter: object  # a pristine ``transformers.core_model_loading.WeightConverter``
    target: str  # the model key the converter is keyed on (its first target)
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> stored keys, in order
    shapes: dict[str, tuple] = field(default_factory=dict)  # model key -> shape, every target
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # model key -> dtype the converter gives

    def _convert(self, model, read: Callable[[str], torch.Tensor | None]) -> dict[str, torch.Tensor]:
        conv = copy.deepcopy(self.converter)
        for pattern, keys in self.sources.items():
            for key in keys:
                conv.add_tensor(self.target, key, pattern, (lambda k=key: read(k)))
        out = conv.convert(self.target, model=model, config=getattr(model, "config", None))
        return {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}

    def stacks_rows(self) -> bool:
        """The converter stacks one stored tensor per row of dim 0 (the experts) and leaves dim 0
        alone afterwards: a slice of rows needs only those stored tensors."""
        from transformers.core_model_loading import MergeModulelist

        ops = list(getattr(self.converter, "operations", ()))
        return (
            bool(ops)
            and isinstance(ops[0], MergeModulelist)
            and ops[0].dim == 0
            and all(keeps_rows(op) for op in ops[1:])
        )

    def maps_rows(self) -> bool:
        """Every operation keeps dim 0 (one stored tensor per source, e.g. MXFP4 dequantisation):
        a slice of rows needs only those rows of each stored tensor."""
        ops = list(getattr(self.converter, "operations", ()))
        return (
            bool(ops)
            and all(keeps_rows(op) for op in ops)
            and all(len(keys) == 1 for keys in self.sources.values())
        )

    def read(
        self,
        model,
        name: str,
        offsets,
        lengths,
        read_stored: Callable[[str], torch.Tensor],
        read_rows: Callable[[str, int, int], torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``model[name][offsets : offsets + lengths]``, reading stored tensors with ``read_stored``
        (rows ``[lo, hi)`` of one with ``read_rows``, where given). A converter that maps rows
        (``maps_rows``) is run on blocks of at most ``_BLOCK_VALUES`` values, each copied into
        ``out`` (returned) when given."""
        if len(offsets) and read_rows is not None and self.maps_rows() and not self.stacks_rows():
            return self._read_row_blocks(model, name, offsets, lengths, read_rows, out)
        lo, hi = (offsets[0], offsets[0] + lengths[0]) if len(offsets) else (0, 0)
        by_rows = len(offsets) > 0 and self.stacks_rows()
        if by_rows:  # only the stored tensors of rows [lo, hi): the rest read as None (skipped)
            index = {k: i for keys in self.sources.values() for i, k in enumerate(keys)}
            full = self._convert(model, lambda k: read_stored(k) if lo <= index[k] < hi else None)[name]
        else:
            full = self._convert(model, read_stored)[name]
        first = 0 if by_rows else offsets[0]
        index = (
            (slice(first, first + lengths[0]), *(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:])))
            if len(offsets)
            else ()
        )
        return full[index]

    def _read_row_blocks(self, model, name, offsets, lengths, read_rows, out) -> torch.Tensor:
        lo, hi = offsets[0], offsets[0] + lengths[0]
        inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
        step = max(1, _BLOCK_VALUES // max(1, math.prod(self.shapes[name][1:])))
        parts = []
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            part = self._convert(model, lambda k, a=a, b=b: read_rows(k, a, b))[name][(slice(None), *inner)]
            if out is None:
                parts.append(part)
            else:
                out[a - lo : b - lo].copy_(part)
            del part
        return out if out is not None else torch.cat(parts)


_BLOCK_VALUES = 2**24
"""Values of one block of rows converted at once by a row-mapping converter (MXFP4 dequantisation:
≈ 20 bytes per value transient in fp32, so ≈ 330 MB; at least one row)."""


@dataclass
class CheckpointKeys:
    """Where each model tensor is in a checkpoint: ``direct`` (model key -> stored key, the same or
    renamed), ``fused`` (model key -> its converter group); stored keys no model key uses:
    ``unused`` (transformers ignores them too)."""

    direct: dict[str, str]
    fused: dict[str, Fused]
    unused: list[str]
    transforms: list = field(default_factory=list)
    """The transforms that matched a stored key: what ``from_pretrained`` keeps as
    ``model._weight_conversions`` so that saving writes the checkpoint's layout back."""

    def has(self, key: str) -> bool:
        return key in self.direct or key in self.fused

    def converted(self) -> bool:
        return bool(self.fused) or any(k != v for k, v in self.direct.items())


def checkpoint_keys(model: nn.Module, stored: dict[str, tuple]) -> CheckpointKeys:
    """Match ``stored`` (key -> (dtype name, shape) from the safetensors headers) to ``model``'s
    state dict (any device, meta included) with transformers' conversion mapping for it."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    own = _transforms(model)
    transforms = own + extra_transforms(model, stored)  # + MXFP4, linearized experts: load only
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    # a LoRA-wrapped linear's weight is stored under the base model's name (``.base_layer`` dropped)
    keys = dict.fromkeys((checkpoint_key(k) for k in model.state_dict() if not is_adapter_param(k)), True)
    prefix = getattr(model, "base_model_prefix", None)
    direct: dict[str, str] = {}
    fused: dict[str, Fused] = {}
    unused: list[str] = []
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, keys)
        if renamed not in keys and key in keys:  # as transformers: a plain key stays itself
            renamed, pattern = key, None
        if renamed not in keys:
            unused.append(key)
        elif pattern is None:
            direct[renamed] = key
        else:
            group = fused.setdefault(renamed, Fused(copy.deepcopy(by_pattern[pattern]), renamed))
            group.sources.setdefault(pattern, []).append(key)
    groups = {id(g): g for g in fused.values()}.values()
    for group in groups:
        counts = {pattern: len(keys) for pattern, keys in group.sources.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"{group.target} is built from stored tensors {counts} (pattern: count), which "
                "should be as many of each: a tensor is missing from the checkpoint"
            )
        try:
            meta = group._convert(model, lambda k: torch.empty(stored[k][1], device="meta"))
        except RuntimeError as e:  # e.g. experts of different shapes
            raise ValueError(
                f"{group.target} cannot be built from its stored tensors as transformers "
                f"does ({' '.join(str(e).split())[:200]}): the weights do not match the "
                "config"
            ) from None
        group.shapes = {name: tuple(t.shape) for name, t in meta.items()}
        group.dtypes = {name: t.dtype for name, t in meta.items()}
        fused.update({name: group for name in group.shapes if name in keys})
    return CheckpointKeys(direct, fused, unused, [t for t in own if t.was_used()])


def stored_shape(plan: CheckpointKeys, stored: dict[str, tuple], key: str) -> list[int]:
    """The shape a model key gets from the checkpoint."""
    if key in plan.direct:
        return list(stored[plan.direct[key]][1])
    return list(plan.fused[key].shapes[key])


# ------------------------------------------------------------------------------------ export
class _Owner:
    """``model`` as transformers' ``revert_weight_conversion`` sees it, with its transforms
    computed once (``_weight_conversions``, the attribute ``from_pretrained`` sets)."""

    def __init__(self, model: nn.Module, transforms: list):
        self._model, self._weight_conversions = model, transforms or None

    def __getattr__(self, name):
        return getattr(self._model, name)


class SaveConversion:
    """Model tensors in, checkpoint tensors out, as ``save_pretrained`` converts them. ``names``:
    every model key that will be added, so a conversion group is converted once all its members
    arrived."""

    def __init__(self, model: nn.Module, names: Iterable[str]):
        from transformers.core_model_loading import PrefixChange, WeightConverter, apply_converters

        transforms = getattr(model, "_weight_conversions", None)
        if transforms is None:  # built from a config: the family's default mapping, as transformers
            transforms = [t for t in _transforms(model, add_legacy=False) if not isinstance(t, PrefixChange)]
        self._owner = _Owner(model, transforms)
        reverse = [t.reverse_transform() for t in transforms[::-1] if isinstance(t, WeightConverter)]
        self._group = {n: apply_converters(n, reverse)[0] for n in names}
        self._left: dict[str, int] = {}
        for g in self._group.values():
            self._left[g] = self._left.get(g, 0) + 1
        self._held: dict[str, dict[str, torch.Tensor]] = {}
        self.active = bool(transforms)

    def add(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors that are complete once ``name`` is added (maybe none yet)."""
        if not self.active:
            return {name: tensor}
        from transformers.core_model_loading import revert_weight_conversion

        group = self._group.get(name, name)
        held = self._held.setdefault(group, {})
        held[name] = tensor
        self._left[group] = self._left.get(group, 1) - 1
        if self._left[group] > 0:
            return {}
        del self._held[group]
        return revert_weight_conversion(self._owner, held)

    def pending(self) -> list[str]:
        return sorted(n for held in self._held.values() for n in held)
