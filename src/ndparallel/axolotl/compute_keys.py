"""Value mappers of ``translate.MAPPERS`` for the compute keys: precision (``bf16: auto``, ``float16``,
``tf32``), activation checkpointing and offloading, the attention kernel, ``torch_compile`` and Liger's
fused-kernel switches."""

from __future__ import annotations

from typing import Any

from ndparallel.axolotl.keys import Translation, is_empty, set_field


def bf16(t: Translation, key: str, value: Any) -> None:
    if value in ("auto", "full"):
        on = _bf16_gpu()
        t.data[key] = on
        t.notes.append(
            f"bf16: {value} -> {str(on).lower()} ("
            + (
                "this machine's GPU computes in bf16)"
                if on
                else "no GPU computing in bf16 here: fp32; on a bf16 GPU the same config trains in bf16)"
            )
        )


def _bf16_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def tf32(t: Translation, key: str, value: Any) -> None:
    if value == "auto":
        import torch

        t.data[key] = bool(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8)


def precision_flag(t: Translation, key: str, value: Any) -> None:
    if is_empty(value):
        return
    if key == "float16":  # Axolotl: load in fp16; here fp16 mixed precision ("fp16: false" beside it is moot)
        if t.data.get("fp16") is False:
            t.data["fp16"] = None
        set_field(
            t,
            "fp16",
            True,
            "float16: true -> fp16: true (fp16 compute, fp32 master weights, dynamic loss "
            "scaling; Axolotl would load the model in fp16, ndparallel keeps fp32 masters)",
            key,
        )
        return
    bf16 = key == "bfloat16"
    set_field(
        t,
        "bf16",
        bf16,
        f"{key}: true -> bf16: {str(bf16).lower()}"
        + (" (bf16 compute, fp32 master weights)" if bf16 else ""),
        key,
    )


def gradient_checkpointing(t: Translation, key: str, value: Any) -> None:
    if value == "offload_disk":
        t.refuse(
            key,
            value,
            "offloading to disk is not supported: use gradient_checkpointing: true with "
            "activation_offloading: true (pinned host memory)",
        )
        return
    if value == "offload":  # Axolotl's deprecated spelling of checkpointing + activation offloading
        set_field(
            t,
            "activation_offloading",
            True,
            "gradient_checkpointing: offload -> activation_offloading: true",
            key,
        )
    if not is_empty(value):
        fsdp = t.data.setdefault("fsdp_config", {}) or {}
        t.data["fsdp_config"] = fsdp
        if fsdp.get("activation_checkpointing") is False:
            t.problems.append(
                "'gradient_checkpointing: true' and 'fsdp_config.activation_checkpointing: false' "
                "disagree; keep one"
            )
            return
        fsdp["activation_checkpointing"] = True
        t.notes.append(
            "gradient_checkpointing: true -> fsdp_config.activation_checkpointing: true (each decoder "
            "layer recomputed in the backward)"
        )


def activation_offloading(t: Translation, key: str, value: Any) -> None:
    if value == "legacy":  # Axolotl's older implementation of the same offload
        t.data[key] = True
        t.notes.append(
            "activation_offloading: legacy -> true (checkpointed activations to pinned host memory)"
        )


def checkpointing_kwargs(t: Translation, key: str, value: Any) -> None:
    if is_empty(value):
        return
    extra = sorted(set(value) - {"use_reentrant"}) if isinstance(value, dict) else [value]
    if extra:
        t.refuse(
            key, value, "only use_reentrant is understood (ndparallel checkpoints non-reentrantly); remove it"
        )
    elif value.get("use_reentrant"):
        t.notes.append(f"{key}: use_reentrant: true -> non-reentrant checkpointing (the same gradients)")


def attention_flag(t: Translation, key: str, value: Any) -> None:
    if value is True:
        impl = {
            "xformers_attention": "sdpa",
            "sage_attention": "sdpa",
            "eager_attention": "eager",
            "flex_attention": "flex_attention",
        }[key]
        why = " (xformers / SageAttention are not used: PyTorch's SDPA kernels)" if impl == "sdpa" else ""
        set_field(t, "attn_implementation", impl, f"{key}: true -> attn_implementation: {impl}{why}", key)


HUB_KERNELS = {
    "flash-attn2": "flash_attention_2",
    "flash-attn3": "flash_attention_3",
    "vllm-flash-attn3": "flash_attention_3",
    "sage-attention": "sdpa",
}


def attn_implementation(t: Translation, key: str, value: Any) -> None:
    if value in ("xformers", "sage", "fp8") or (isinstance(value, str) and "/" in value):
        impl = HUB_KERNELS.get(value.rsplit("/", 1)[-1]) if "/" in value else "sdpa"
        if impl is None:
            t.refuse(
                key,
                value,
                "hub kernels are not loaded: use eager, sdpa, flash_attention_2, flash_attention_3 "
                "or flex_attention",
            )
            return
        t.data[key] = impl
        t.notes.append(
            f"attn_implementation: {value} -> {impl} (the same attention, a kernel ndparallel loads)"
        )


def torch_compile(t: Translation, key: str, value: Any) -> None:
    if value == "auto":
        import torch

        value = torch.cuda.is_available()
        t.notes.append(f"torch_compile: auto -> {str(value).lower()} (on with a CUDA GPU)")
    set_field(t, "compile", value, "", key)
    t.renamed["compile"] = key


def liger(t: Translation, key: str, value: Any) -> None:
    if is_empty(value):
        return
    if "cross_entropy" in key:
        t.notes.append(f"{key}: true -> the chunked loss (chunked_loss: on where exact)")
        return
    if "compile" not in t.data and "torch_compile" not in t.data:  # the config's own choice wins
        t.data["compile"] = True
        t.notes.append(
            f"{key}: true -> torch_compile: true (regional compile; inductor fuses the norms, "
            "activations and rotary embeddings Liger fuses by hand)"
        )
