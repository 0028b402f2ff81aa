"""Fine-tuning records -> text segments, each trained or not (the prompt is not, the answer is).

A record of a dataset ``type`` becomes a :class:`Rendered`: a list of ``(text, trained)``
segments whose concatenation is the sample's text, whether the tokenizer adds its own special
tokens (a BOS) and whether an eos is appended (trained when the last segment is). ``encode.py``
turns it into ``input_ids`` and ``labels`` (-100 where not trained). Types (Axolotl's names):

* ``alpaca``: columns ``instruction``, ``input`` (optional), ``output``. The prompt is Alpaca's
  (``### Instruction: ... ### Response:``; the "with input" one when ``input`` is non-empty, spaces
  included, as in Axolotl), the answer is ``output`` + eos, tokenised apart from the prompt.
  ``alpaca:<style>`` uses Axolotl's other turn formats (``chat``: ``USER: ... ASSISTANT:``,
  ``chatml``, ``phi``) with the same system text.
* ``completion`` / ``pretrain`` (and the raw-text file types): the ``text_field`` column, all trained.
* ``jeopardy``: columns ``question``, ``category``, ``answer``: the Alpaca prompt (clue as
  instruction, category as input), the answer trained as ``what is <answer>`` (Axolotl's).
* ``input_output``: a ``segments`` column of ``{"text": ..., "label": true|false}``; the text is
  used as written (no BOS or eos added), ``label`` says whether a segment is trained.
* ``chat_template``: a ``messages`` / ``conversations`` column rendered with a chat template
  (``chat.py``).
* a mapping (Axolotl's custom format: ``format``, ``field_instruction`` ...): the prompt from the
  user's format strings, the output column the answer + eos (``instruct.py``).

A record that does not fit its type (a missing or null column, a wrong JSON type) raises
``ValueError`` naming the dataset, the row and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .dataset import DatasetSpec, required_columns  # noqa: F401 - imported from here by check, pipeline
from .instruct import render_prompt

Segment = tuple[str, bool]

ALPACA_SYSTEM = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request."
)
ALPACA_SYSTEM_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request."
)
ALPACA_TURNS = {  # style: (system format, turn with input, turn without input): Axolotl's AlpacaPrompter
    "instruct": (
        "{system}\n\n",
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "### Instruction:\n{instruction}\n\n### Response:\n",
    ),
    "chat": (
        "SYSTEM: {system}\n",
        "USER: {instruction}\n{input}\nASSISTANT:",
        "USER: {instruction}\nASSISTANT:",
    ),
    "chatml": (
        "<|im_start|>system\n{system}<|im_end|>\n",
        "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
    ),
    "phi": (
        "<|system|>\n{system}<|end|>\n",
        "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
        "<|user|>\n{instruction}<|end|>\n<|assistant|>\n",
    ),
}
ALPACA_WITH_INPUT = ALPACA_TURNS["instruct"][0].format(system=ALPACA_SYSTEM) + ALPACA_TURNS["instruct"][1]
ALPACA_NO_INPUT = (
    ALPACA_TURNS["instruct"][0].format(system=ALPACA_SYSTEM_NO_INPUT) + ALPACA_TURNS["instruct"][2]
)


@dataclass(frozen=True)
class Rendered:
    """One sample before tokenization."""

    segments: list[Segment]
    add_special_tokens: bool = True  # the tokenizer's own BOS convention
    append_eos: bool = True  # an eos id after the text, trained when the last segment is
    separately: bool = False  # each segment tokenised alone (a prompt and its answer, as Axolotl)


def render(record: Mapping[str, Any], spec: DatasetSpec, where: str, chat=None) -> Rendered:
    """``record`` as segments; ``chat``: a ``chat.ChatRenderer`` (needed for ``chat_template``)."""
    if spec.raw:
        return Rendered([(_text(record, spec.text_field, where), True)])
    if spec.base_type == "alpaca":
        return alpaca(record, where, spec.type.partition(":")[2] or "instruct")
    if spec.type == "input_output":
        return input_output(record, where)
    if spec.type == "jeopardy":
        return jeopardy(record, where)
    if spec.format is not None:
        prompt, output = render_prompt(record, spec.format, where)
        return Rendered([(prompt, False), (output, True)], separately=True)
    if chat is None:
        raise ValueError(f"{where}: type chat_template needs a chat template")
    return Rendered(chat.segments(record, where), add_special_tokens=False, append_eos=False)


def alpaca(record: Mapping[str, Any], where: str, style: str = "instruct") -> Rendered:
    instruction = _text(record, "instruction", where)
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise ValueError(f"{where}: 'input' is a {type(extra).__name__}, not text")
    system, with_input, without = ALPACA_TURNS[style]
    if extra:  # Axolotl's test: an input of spaces only is an input
        prompt = system.format(system=ALPACA_SYSTEM) + with_input.format(instruction=instruction, input=extra)
    else:
        prompt = system.format(system=ALPACA_SYSTEM_NO_INPUT) + without.format(instruction=instruction)
    return Rendered([(prompt, False), (_text(record, "output", where), True)], separately=True)


def jeopardy(record: Mapping[str, Any], where: str) -> Rendered:
    """Axolotl's ``jeopardy``: the Alpaca prompt with the clue as instruction and the category as
    input; the trained answer is "what is <answer>"."""
    fields = {
        "instruction": _text(record, "question", where),
        "input": _text(record, "category", where),
        "output": "what is " + _text(record, "answer", where),
    }
    return alpaca(fields, where)


def input_output(record: Mapping[str, Any], where: str) -> Rendered:
    segments = record.get("segments")
    if not isinstance(segments, list) or not segments:
        raise ValueError(
            f'{where}: \'segments\' must be a non-empty list of {{"text": ..., "label": true|false}}, '
            f"got {_short(segments)}"
        )
    out = []
    for i, seg in enumerate(segments):
        if (
            not isinstance(seg, Mapping)
            or not isinstance(seg.get("text"), str)
            or not isinstance(seg.get("label"), bool)
        ):
            raise ValueError(
                f'{where}: segments[{i}] must be {{"text": str, "label": bool}}, got {_short(seg)}'
            )
        out.append((seg["text"], seg["label"]))
    return Rendered(out, add_special_tokens=False, append_eos=False)


def _text(record: Mapping[str, Any], column: str, where: str) -> str:
    value = record.get(column)
    if not isinstance(value, str):
        what = "missing or null" if value is None else f"a {type(value).__name__}, not text"
        raise ValueError(f"{where}: column {column!r} is {what}; every record needs it as a string")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
