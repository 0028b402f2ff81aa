"""Axolotl's named chat templates (``data/chat_templates``), one test each: a conversation rendered
through a tokenizer of the template's family tokens (a byte-level BPE trained here, the family's
special tokens atomic, its bos/eos) is split so that exactly the assistant contents and their end
of turn are trained — checked on the text and on the token labels ``encode`` gives. Plus the
chat features Axolotl configs use: system prompts folded into the first user turn (Gemma 3),
``drop_system_message``, reasoning text (``field_thinking``), ``roles``, template kwargs."""

from __future__ import annotations

import re

import pytest

from ndparallel.data.chat import ChatRenderer, named_template, resolve_template, template_names
from ndparallel.data.dataset import DatasetSpec
from ndparallel.data.encode import encode
from ndparallel.data.prompts import Rendered

_TOKEN = re.compile(r"<\|?[A-Za-z_▁｜|]+\|?>|\[/?INST\]|\[\|[a-z]+\|\]|<[a-z_]+\|>|<\|[a-z_]+>|<｜[^｜]+｜>")
EOS = {"deepseek_v2": "<｜end▁of▁sentence｜>", "deepseek_v3": "<｜end▁of▁sentence｜>"}
"""The family's eos where its template writes it literally (else ``</s>``)."""
END = {
    "alpaca": "</s>",
    "aya": "<|END_OF_TURN_TOKEN|>",
    "chatml": "<|im_end|>",
    "cohere": "<|END_OF_TURN_TOKEN|>",
    "command_a": "<|END_OF_TURN_TOKEN|>",
    "command_a_rag": "<|END_OF_TURN_TOKEN|>",
    "command_a_tool_use": "<|END_OF_TURN_TOKEN|>",
    "deepseek_v2": "<｜end▁of▁sentence｜>",
    "deepseek_v3": "<｜end▁of▁sentence｜>",
    "exaone": "[|endofturn|]",
    "exaone4": "[|endofturn|]",
    "falcon_h1": "<|im_end|>",
    "gemma": "<end_of_turn>",
    "gemma3": "<end_of_turn>",
    "gemma3n": "<end_of_turn>",
    "gemma4": "<turn|>",
    "gemma4_unified": "<turn|>",
    "jamba": "<|eom|>",
    "llama3": "<|eot_id|>",
    "llama3_2_vision": "<|eot_id|>",
    "llama4": "<|eot|>",
    "llava": None,
    "metharme": "last:</s>",
    "mistral_v1": "</s>",
    "mistral_v2v3": "</s>",
    "mistral_v3_tekken": "</s>",
    "mistral_v7_tekken": "</s>",
    "nemotron_h": "<|im_end|>",
    "phi_3": "<|end|>",
    "phi_35": "<|end|>",
    "phi_4": "<|im_end|>",
    "pixtral": "</s>",
    "qwen2_vl": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "qwen3_5": "<|im_end|>",
    "qwen_25": "<|im_end|>",
}
"""What ends a trained assistant turn in each template (``last:``: only the conversation's end;
None: nothing — LLaVA's template writes no end of turn)."""
NO_SYSTEM = {"gemma", "mistral_v2v3", "mistral_v3_tekken", "pixtral"}
"""Templates that refuse a system message."""
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "the answer is yes"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "a list of words"},
]


def family_tokenizer(template: str, eos: str = "</s>"):
    """A small byte-level BPE with the template's special tokens as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = sorted(set(_TOKEN.findall(template)) | {"<s>", eos, "<pad>"})
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = " ".join(m["content"] for m in CONVERSATION)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([words] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos, pad_token="<pad>")


def _setup(name: str, **spec):
    """The template's renderer, its turn end given as eot_tokens where it is not the eos (unset, only
    the eos ends a turn, as in Axolotl)."""
    text = named_template(name)
    eos = EOS.get(name, "</s>")
    tok = family_tokenizer(text, eos)
    end = (END[name] or "").removeprefix("last:")
    eot = (end,) if end and end != eos and end in tok.get_vocab() else None
    renderer = ChatRenderer(tok, text, DatasetSpec(path="x", type="chat_template", **spec), eot)
    messages = CONVERSATION[1:] if name in NO_SYSTEM else CONVERSATION
    return tok, renderer, messages


@pytest.mark.parametrize("name", template_names())
def test_named_template_trains_exactly_the_assistant_turns(name):
    tok, renderer, messages = _setup(name)
    segments = renderer.segments({"messages": messages}, "t")
    rendered = tok.apply_chat_template(messages, chat_template=named_template(name), tokenize=False)
    assert "".join(t for t, _ in segments) == rendered  # the split covers the rendered text exactly
    trained = [t for t, f in segments if f]
    end = END[name]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    if end is None:
        expected = answers
    elif end.startswith("last:"):
        expected = [*answers, end.removeprefix("last:")]
    else:
        expected = [x for a in answers for x in (a, end)]
    assert trained == expected, (name, segments)
    for m in messages[:-1]:
        if m["role"] != "assistant":
            assert not any(m["content"] in t for t in trained)
    ids, labels = encode(tok, Rendered(segments, add_special_tokens=False, append_eos=False))
    learned = tok.decode([i for i, lab in zip(ids, labels) if lab != -100])
    assert "".join(learned.split()) == "".join("".join(expected).split())  # a token may carry a header space


@pytest.mark.parametrize("name", ["chatml", "qwen3", "gemma3"])
def test_named_template_or_the_tokenizers_own(name):
    tok = family_tokenizer(named_template(name))
    assert resolve_template(tok, name, None, "t") == named_template(name)
    tok.chat_template = named_template(name) + "\n"  # the same text: the tokenizer's own is used
    assert resolve_template(tok, name, None, "t") is tok.chat_template
    with pytest.raises(ValueError, match="did you mean 'qwen3'"):
        resolve_template(tok, "qwen_3", None, "t")


def test_gemma3_folds_the_system_prompt_into_the_first_user_turn():
    tok, renderer, messages = _setup("gemma3")
    segments = renderer.segments({"messages": messages}, "t")
    first_user = next(t for t, f in segments if "hello there" in t)
    assert "Be brief.\n\nhello there" in first_user  # folded, and not trained
    assert not any("Be brief." in t for t, f in segments if f)


def test_drop_system_message_thinking_roles_and_template_kwargs():
    tok, renderer, _ = _setup(
        "qwen3",
        drop_system_message=True,
        field_thinking="thinking",
        roles={"assistant": ["bot"], "user": ["human"]},
    )
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "human", "content": "hello there"},
            {"role": "bot", "content": "the answer is yes", "thinking": "a list"},
        ]
    }
    segments = renderer.segments(record, "t")
    text = "".join(t for t, _ in segments)
    assert "Be brief." not in text and "<|im_start|>assistant" in text  # system dropped, roles mapped
    trained = "".join(t for t, f in segments if f)
    assert (
        trained.startswith("a list")
        and "</think>" in trained
        and trained.endswith("the answer is yes<|im_end|>")
    )
    quiet = ChatRenderer(
        tok,
        named_template("qwen3"),
        DatasetSpec(path="x", type="chat_template"),
        template_kwargs={"enable_thinking": False},
    )
    plain = ChatRenderer(tok, named_template("qwen3"), DatasetSpec(path="x", type="chat_template"))
    msgs = [{"role": "user", "content": "hi"}]
    assert quiet.render(msgs, add_generation_prompt=True) != plain.render(msgs, add_generation_prompt=True)
