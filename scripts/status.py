"""The one table of what works, how it is tested and whether it ran on a GPU.

``python scripts/status.py`` renders it into docs/status.md (every row) and into the README's support
matrix (the rows with a ``front`` name); ``tests/test_docs.py`` fails when either file is stale, when
a named test file or docs page is missing, or when a GPU cell claims a run the docs do not date."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = (
    "<!-- support-matrix:start (generated: python scripts/status.py) -->",
    "<!-- support-matrix:end -->",
)
NOT_RUN = "not run"


@dataclass(frozen=True)
class Row:
    feature: str  # what, with its options (status page)
    state: str  # what the tests show, on CPU ranks unless said
    gpu: str  # NOT_RUN, "—" (nothing GPU-specific) or what ran on a GPU (dated in docs/benchmarks.md)
    tests: tuple[str, ...]  # test files (globs allowed) that prove ``state``; at least one under tests/
    page: str  # the docs page (relative to docs/, optional #anchor)
    front: str = ""  # the row's name in the README's support matrix; "" = docs/status.md only
    result: str = ""  # the README's short form of ``state``


AREAS: dict[str, tuple[Row, ...]] = {
    "Parallel dimensions and their compositions": (
        Row(
            "5-D `DeviceMesh` `(pp, dp_replicate, dp_shard, cp, tp)` and its flattened views; "
            "`ParallelismConfig` (degrees, `-1` fill, env vars, validation naming the field)",
            "works: exact rank groups for each of its layouts, 1–8 ranks",
            "—",
            ("tests/test_mesh.py", "tests/test_parallelism_config.py"),
            "python_api.md",
        ),
        Row(
            "pipeline parallel (`pipeline_parallel_size`): GPipe, 1F1B, Interleaved 1F1B, zero-bubble; "
            "× FSDP / DP / TP / CP / EP; LoRA / QLoRA; tied embeddings; resume on another PP size; "
            "`acc.pipeline_step`",
            "= 1 process (Llama, Qwen3, Qwen3-MoE); compile composes; `lora_modules_to_save` on tied "
            "embeddings, the MoE router loss and fp8 refused by name",
            NOT_RUN,
            ("tests/test_pipeline_*.py",),
            "pipeline_parallel.md",
            "PP: pipeline parallel (GPipe, 1F1B, interleaved, zero bubble)",
            "= 1 process",
        ),
        Row(
            "DP, FSDP2, HSDP (+ gradient accumulation, activation checkpointing full or selective, "
            "reshard on/off, CPU offload, bf16); layout-invariant loss (global token count), "
            "global grad norm on mixed meshes",
            "= 1 process",
            "1 GPU (H200): bf16 train, resume, export, CPU offload; multi-GPU not run",
            ("tests/test_fsdp_equivalence.py", "tests/test_selective_ac.py"),
            "python_api.md",
            "DP, FSDP2, HSDP",
            "= 1 process",
        ),
        Row(
            "CP: own ring, all-gather and all-to-all (Ulysses) attention, load-balanced, GQA, padding; "
            "sliding-window / chunked attention, soft-capping, MLA value dims",
            "= 1 process",
            "1 GPU (H200): block kernels exact; multi-GPU not run",
            ("tests/test_cp_*.py", "tests/test_context_parallel.py"),
            "context_parallel.md",
            "CP: context parallel (ring, all-gather, Ulysses)",
            "= 1 process",
        ),
        Row(
            "TP (+ sequence parallel, loss parallel, tied embeddings, transformers' own TP path)",
            "= 1 process (Llama, Qwen2, Qwen3, Mistral; the family matrix for the rest)",
            NOT_RUN,
            ("tests/test_tensor_parallel*.py",),
            "tensor_parallel.md",
            "TP: tensor parallel (+ sequence / loss parallel)",
            "= 1 process",
        ),
        Row(
            "expert parallel (`expert_parallel_size`) × FSDP / HSDP / TP / CP: all-to-all dispatch, "
            "grouped GEMM, the global load-balancing loss, LoRA, checkpoints across ep",
            "= 1 process",
            NOT_RUN,
            ("tests/test_moe_equivalence.py", "tests/test_moe.py"),
            "moe.md",
            "EP: expert parallel (mixture of experts)",
            "= 1 process",
        ),
        Row(
            "compositions FSDP×CP, HSDP×CP, TP×CP, FSDP×TP (SP/LP), HSDP×TP, FSDP×CP×TP, 2×2×2×2 (16 ranks)",
            "= 1 process",
            NOT_RUN,
            ("tests/test_compositions.py", "tests/test_tensor_parallel_compositions.py"),
            "status.md#parallel-dimensions-and-their-compositions",
            "compositions of all of the above, up to 16 ranks",
            "= 1 process",
        ),
        Row(
            "packed documents (`position_ids` restarting at 0): attention never crosses a document start — "
            "1 process, TP, FSDP×CP, TP×CP, every CP strategy, `verify`",
            "= documents run separately",
            NOT_RUN,
            ("tests/test_packed_documents.py", "tests/test_cp_kernels.py"),
            "context_parallel.md",
        ),
    ),
    "Front doors": (
        Row(
            "`Accelerator`: every name of Accelerate's API table, its constructor arguments, plugins, "
            "handlers and `accelerate launch --config_file` honoured or refused by name",
            "works",
            NOT_RUN,
            ("tests/test_accelerate_*.py",),
            "accelerate.md",
        ),
        Row(
            "Accelerate drop-in: its `nd_parallel.py`, the ND-parallel blog's snippet and the CP guide's "
            "loop "
            "with only the imports changed (FSDP×CP, HSDP, TP, FSDP×CP×TP)",
            "= our loop on 1 process",
            NOT_RUN,
            ("tests/test_accelerate_dropin.py",),
            "accelerate.md",
            "Accelerate scripts, imports changed",
            "= 1 process; FSDP 4 losses bit-identical to Accelerate 1.16.0 itself",
        ),
        Row(
            "transformers' `Trainer` and TRL's `SFTTrainer` / `DPOTrainer` with only the imports changed "
            "(`ndparallel.transformers`, `ndparallel.trl`; `parallel_trainer` for any `Trainer` subclass): "
            "Accelerate's `nd_parallel_trainer.py`, gradient accumulation, evaluation, checkpoints resumed "
            "on another layout, trackers, callbacks, bf16; SFT (completion-only, chat, packing, "
            "padding-free), DPO (sharded reference model, LoRA; on CP each model call split and gathered "
            "back); a LoRA `save_model` writes the adapter directory",
            "= transformers' Trainer on Accelerate / TRL 1.16.0 themselves in one process (1 rank, CP 2, "
            "TP 2, TP 2 + SP after a resume, FSDP 2, FSDP 2 × CP 2, HSDP 2 × 2, FSDP 2 × TP 2; a MoE on "
            "FSDP 2 × EP 2); PP, and SP "
            "with a TRL trainer, refused by name",
            NOT_RUN,
            ("tests/test_trainer_door.py", "tests/test_trainer_features.py", "tests/test_trl_door.py"),
            "trainer.md",
            "transformers' Trainer and TRL, imports changed",
            "= transformers' Trainer and TRL 1.16.0 themselves in 1 process",
        ),
        Row(
            "`ndparallel train` (YAML with Axolotl's field names, data pipeline, metrics, eval, export); "
            "`preprocess` (`--show N`, `--json`)",
            "works",
            "1 GPU (H200): bf16 train",
            ("tests/test_train*.py", "tests/test_axolotl_config.py"),
            "cli.md",
        ),
        Row(
            "Axolotl configs as written: every key of its schema honoured, mapped (one note), no-op when "
            "empty or refused with the fix; its 198 causal-LM examples replayed",
            "182 of 198 examples accepted unchanged, 169 pass `--dry-run` with tiny stand-ins; the rest "
            "listed with their reasons",
            NOT_RUN,
            ("tests/test_axolotl_examples*.py", "tests/test_axolotl_features.py"),
            "axolotl.md#the-replay-of-axolotls-examples",
        ),
        Row(
            "the same training examples and losses as Axolotl 0.19 itself, run next to us (fixtures kept)",
            "20 of 21 configs give the same examples token for token (the 21st: documented); the same "
            "losses for 10 steps",
            NOT_RUN,
            ("tests/test_axolotl_parity.py",),
            "axolotl.md#the-same-examples-as-axolotl-itself",
            "Axolotl configs as written",
            "the same examples as Axolotl 0.19: 20 of 21 configs token for token, 1 documented",
        ),
        Row(
            "fine-tuning data like Axolotl: `alpaca`, `chat_template`, custom formats, `input_output`, "
            "`completion`; local files or Hub; exactly the prompt masked",
            "works",
            "—",
            ("tests/test_data_*.py",),
            "data.md",
        ),
        Row(
            "`sample_packing` (attention per sample), `pad_to_sequence_len`; memory-mapped rows, host "
            "memory per rank independent of the dataset size",
            "= samples trained one by one (1 process, FSDP×TP, FSDP×CP×TP)",
            "—",
            ("tests/test_sft_equivalence.py", "tests/test_data_store.py"),
            "data.md",
            "sample packing of fine-tuning data",
            "= samples trained one by one",
        ),
        Row(
            "model families (23) on FSDP, TP, CP, FSDP×TP, FSDP×CP, TP+SP with packed rows; a shrunk "
            "check before launch for any other family; multimodal checkpoints trained on text",
            "126 of 138 cells = 1 process, 12 refused before launch (one line, exit 2)",
            NOT_RUN,
            ("tests/test_family_matrix.py", "tests/test_family_support.py", "tests/test_multimodal.py"),
            "families.md",
            "23 model families × 6 layouts",
            "126 of 138 cells = 1 process, 12 refused",
        ),
    ),
    "Training features": (
        Row(
            "LoRA via PEFT on every layout and PP; base frozen bit for bit; adapter-only grads, optimizer "
            "and checkpoints; `lora_modules_to_save`, `lora_target_parameters`, `lora_model_dir`; "
            "offline merge",
            "= 1 process",
            NOT_RUN,
            ("tests/test_lora*.py",),
            "lora.md",
            "LoRA (PEFT) on every layout",
            "= 1 process",
        ),
        Row(
            "QLoRA (`adapter: qlora`): 4-bit NF4 base (torchao) sharded by FSDP2; DP, FSDP, HSDP, FSDP×CP, "
            "CPU offload, PP × FSDP; TP refused by name",
            "= QLoRA on 1 process (base bit for bit)",
            NOT_RUN,
            ("tests/test_qlora*.py",),
            "lora.md",
            "QLoRA (4-bit NF4 base)",
            "= 1 process",
        ),
        Row(
            "quantisation-aware training (Axolotl's `qat:`, torchao fake quantisation) on DP, FSDP2, HSDP, "
            "CP; with LoRA; TP / fp8 / QLoRA refused by name",
            "= 1 process (first step exact, then within quantisation-level flips)",
            NOT_RUN,
            ("tests/test_qat.py", "tests/test_plan_qat.py"),
            "qat.md",
            "quantisation-aware training",
            "= 1 process",
        ),
        Row(
            "fp16 mixed precision: fp32 masters, dynamic loss scaling decided on the global grad norm, the "
            "scale "
            "in checkpoints; bf16",
            "= 1 process within fp16 rounding (FSDP, DP×FSDP)",
            "1 GPU (H200): bf16; fp16 not run",
            ("tests/test_fp16.py",),
            "precision.md",
            "bf16 / fp16 mixed precision",
            "= 1 process",
        ),
        Row(
            "8-bit / 4-bit AdamW through torchao (states quantised per parameter); Muon (each matrix "
            "orthogonalised whole from its shards)",
            "= 1 process (Muon; low-bit AdamW on FSDP); under TP losses equal, parameters at 8-bit noise",
            NOT_RUN,
            ("tests/test_optim_*.py",),
            "optimizers.md",
            "Muon, 8-bit / 4-bit AdamW",
            "= 1 process",
        ),
        Row(
            "chunked loss (no full logits), loss parallel under TP, regional `torch.compile`, fp8 "
            "(torchao float8 linears), no host sync per step",
            "= the plain path (fp8: wiring on CPU emulation)",
            "speed not measured",
            (
                "tests/test_chunked_loss.py",
                "tests/test_compile.py",
                "tests/test_float8.py",
                "tests/test_host_sync.py",
            ),
            "performance.md",
            "chunked loss, compile, fp8",
            "= the plain path",
        ),
        Row(
            "long context: sequence-tiled MLP, activation offloading of the checkpointed layer inputs, "
            "selective checkpointing; on 1 process, FSDP×CP, TP+SP×CP, PP, LoRA, compile",
            "= plain run; CUDA stream path checked with simulated streams only",
            NOT_RUN,
            (
                "tests/test_long_context.py",
                "tests/test_lean_norm.py",
                "tests/test_offload_streams.py",
                "tests/test_selective_ac.py",
            ),
            "long_context.md",
            "tiled MLP, activation offloading",
            "= plain run",
        ),
    ),
    "Checkpoints, loading, runtime": (
        Row(
            "checkpoints (DCP, atomic completion, rotation, resume on another layout), HF export; "
            "asynchronous checkpoints",
            "works; async = sync bit for bit",
            "1 GPU (H200): save, resume, export; async not run",
            ("tests/test_checkpoint*.py", "tests/test_export.py"),
            "checkpoints.md",
            "checkpoints: resume on another layout, async, HF export",
            "works",
        ),
        Row(
            "`acc.load_model`: meta-device build, only this rank's shards read; the checkpoint formats "
            "transformers converts, gpt-oss MXFP4 experts, Llama 4's linearized experts",
            "works, = `from_pretrained` / the bf16 reference",
            NOT_RUN,
            (
                "tests/test_model_loading.py",
                "tests/test_family_loading.py",
                "tests/test_checkpoint_formats.py",
                "tests/test_axolotl_checkpoint_keys.py",
            ),
            "loading.md",
            "sharded loading (each rank reads its shards)",
            "works",
        ),
        Row(
            "faults: a dead, raising or hung rank ends the job within the timeout, naming it; "
            "`max_restarts`; diverging runs stop naming the step (or `on_nonfinite: skip`)",
            "works",
            "1 GPU (H200): NCCL sub-group timeouts, init paths",
            ("tests/test_faults*.py", "tests/test_nonfinite.py", "tests/test_prepare_init.py"),
            "runtime.md",
            "faults, timeouts, divergence",
            "works",
        ),
        Row(
            "`ndparallel launch`: torch's elastic agent, every torchrun option, CPU threads per rank; "
            "SIGUSR1 forwarded; ranks die with a `kill -9`-ed launcher",
            "works",
            NOT_RUN,
            ("tests/test_harness_and_launch.py", "tests/test_faults_launcher.py"),
            "multi_node.md",
        ),
        Row(
            "multi-node on one machine: 2 launchers × 2 ranks = 1 × 4 exactly; a dead node named; SLURM "
            "example; preemption (a signal → one agreed step, checkpoint, exit 75, resume exactly)",
            "works on one machine",
            "NCCL across nodes, real clusters not run",
            ("tests/test_cluster.py", "tests/test_faults_launcher.py"),
            "multi_node.md",
            "several nodes, SLURM, preemption",
            "works on one machine",
        ),
        Row(
            "bad input: one line naming the field and the fix, exit 2, before launch; nothing a user wrote "
            "deleted or overwritten",
            "works (~100 cases)",
            "—",
            ("tests/test_bad_inputs.py",),
            "cli.md#exit-codes",
        ),
        Row(
            "communication accounting (`--profile-comm`, `CommProfiler`)",
            "works",
            "—",
            ("tests/test_comm_profile.py",),
            "benchmarks.md#communication-accounting",
        ),
    ),
    "Tools before a cluster": (
        Row(
            "`ndparallel verify`: a shrunk model, the config's layout and options through the trainer's own "
            "step; verdict on fp32 losses, grad norms and parameters",
            "works",
            "1 GPU (H200)",
            ("tests/test_train.py",),
            "cli.md#verify",
            "`verify`: the config's layout = one device?",
            "works",
        ),
        Row(
            "`ndparallel plan`: memory and time of every layout (PP and EP included), ranked; "
            "`--calibrate`, `--max-seq-len`",
            "works; 1-GPU rows on an H200: peak memory −0.1 to −0.2 %, tokens/s −5.0 to +4.6 %; the 405B "
            "anchor: 37.5–40.8 % MFU predicted vs the 43 % Meta published; multi-GPU not measured",
            "1 GPU (H200): the 1-GPU rows; multi-GPU not run",
            ("tests/test_plan_*.py",),
            "planner.md",
            "`plan`: which layout fits and is fastest",
            "works",
        ),
        Row(
            "`ndparallel simulate`: one real rank of an 8–1024-rank world here over torch's fake "
            "collectives, measured beside the planner's prediction",
            "works on CPU (a rank of 64: tensor memory within 15 % of the planner)",
            NOT_RUN,
            ("tests/test_simulate.py",),
            "simulate.md",
            "`simulate`: one real rank of a 64–1024-GPU job",
            "works",
        ),
        Row(
            "GPU acceptance in one command: `bash bench/gpu_all.sh` (every one-GPU check, one time budget)",
            "its CPU form passes in the suite",
            NOT_RUN,
            ("tests/test_gpu_all.py", "tests/test_bench_gpu_single.py"),
            "benchmarks.md#gpu-acceptance-in-one-command-benchgpu_allsh",
        ),
    ),
}


def _link(page: str) -> str:
    return f"[{page.split('#')[0].removesuffix('.md')}]({page})"


def status_page() -> str:
    head = [
        "# Status: what works, and how it is tested",
        "<!-- generated by `python scripts/status.py` from its table: do not edit -->",
        "",
        "Every feature, what its tests show and whether it ever ran on a GPU. **= 1 process**: the same",
        "model, data and seed give the same per-step losses, gradient norms and (SGD) parameters on one",
        "process and under the layout, by [the one rule](testing.md#equal-to-one-process); multi-rank",
        "results are CPU ranks over gloo. **GPU**: what ran on one H200, single-GPU runs only, dated in",
        "[benchmarks.md](benchmarks.md#gpu-results-so-far-one-h200-141-gb). Edit `scripts/status.py`'s",
        "table, then run it: it rewrites this page and the README's support matrix.",
    ]
    out = head
    for area, rows in AREAS.items():
        out += ["", f"## {area}", "", "| feature | state | GPU | tested by | docs |", "|---|---|---|---|---|"]
        for r in rows:
            tests = ", ".join(f"`{t}`" for t in r.tests)
            out.append(f"| {r.feature} | {r.state} | {r.gpu} | {tests} | {_link(r.page)} |")
    return "\n".join(out) + "\n"


def support_matrix() -> str:
    rows = ["| | tested on CPU ranks | on a GPU | docs |", "|---|---|---|---|"]
    for area_rows in AREAS.values():
        for r in area_rows:
            if r.front:
                rows.append(f"| {r.front} | {r.result} | {r.gpu} | [{r.page.split('#')[0]}](docs/{r.page}) |")
    return "\n".join(rows)


def replace_block(text: str, block: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + block + "\n" + text[end:]


def current_block(text: str) -> str:
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n")


def main() -> int:
    (ROOT / "docs" / "status.md").write_text(status_page())
    readme = ROOT / "README.md"
    readme.write_text(replace_block(readme.read_text(), support_matrix()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
