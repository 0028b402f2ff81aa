"""``type: chat_template``: a conversation rendered with a chat template, split into trained and
untrained text.

The template is the tokenizer's own (``tokenizer_default``), one of Axolotl's named templates
(``chat_templates/*.jinja``: ``chatml``, ``llama3``, ``qwen3``, ``gemma3``, ``phi_3``, ...) or a
Jinja string / file (``chat_template: jinja`` with ``chat_template_jinja``). Turn boundaries come
from the template itself: turn ``i`` is the text that rendering ``messages[:i+1]`` adds to
rendering ``messages[:i]`` (a template must render a conversation's prefix as a prefix of its
text; one that does not is refused with the row named). A turn that is not trained needs no more:
templates that fold the system prompt into the first user turn (Gemma 3) render the system turn
as nothing and the next turn holds both. Inside a trained turn (role in ``roles_to_train``,
default ``["assistant"]``) the content — and its reasoning text, ``field_thinking``, when the
template renders it — is trained; the role header never is; the end-of-turn token (the eos, or a
turn token the template uses such as ``<|eot_id|>``/``<|im_end|>``) per ``train_on_eos``:
``turn`` (of trained turns, the default), ``all``, ``last`` (the last turn's), ``none`` — and
``train_on_eot`` for an end-of-turn token that is not the eos (default: as ``train_on_eos``).
The end-of-turn tokens are the eos and the run's ``eot_tokens``, those the template uses; with
``eot_tokens`` unset only the eos, as in Axolotl: a template that ends turns with another token
(ChatML's ``<|im_end|>`` under a base model's eos) then trains no turn end, said before launch.
``train_on_inputs: true`` trains the turns of every role (content and end of turn, as
``roles_to_train`` would), never the role headers, as Axolotl does.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .dataset import DatasetSpec
from .prompts import Segment, _short

TEMPLATE_DIR = Path(__file__).parent / "chat_templates"
"""Axolotl's named templates, one ``NAME.jinja`` each (Apache-2.0; see its README)."""
FALLBACK_PREFIX = "tokenizer_default_fallback_"


@functools.cache
def template_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja")))


@functools.cache
def named_template(name: str) -> str:
    return (TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


LLAMA3 = named_template("llama3")
TURN_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eot|>",
    "<turn|>",
    "<|END_OF_TURN_TOKEN|>",
    "[|endofturn|]",
    "<|eom|>",
)
ROLE_NAMES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
"""ShareGPT-style role names -> the chat-template ones."""
TRAIN_ON_EOS = ("turn", "all", "last", "none")


def check_template_name(name: str | None, where: str, jinja: str | None = None) -> None:
    """``ValueError`` for a ``chat_template`` that names no template (checked before any data)."""
    if name in (None, "tokenizer_default") or (name == "jinja" and jinja):
        return
    base = name.removeprefix(FALLBACK_PREFIX)
    if base in template_names():
        return
    if name == "jinja":
        raise ValueError(
            f"{where}: chat_template: jinja needs chat_template_jinja (a template or a .jinja file)"
        )
    close = difflib.get_close_matches(base, template_names(), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"{where}.chat_template: unknown template {name!r}; {hint}use tokenizer_default, jinja (with "
        f"chat_template_jinja) or one of {', '.join(template_names())}"
    )


def resolve_template(tokenizer, name: str | None, jinja: str | None, where: str) -> str:
    """The Jinja text of the template to use (``name`` None = the tokenizer's own). A named
    template whose text the tokenizer already has gives the tokenizer's own."""
    if jinja:
        path = Path(jinja).expanduser()
        return path.read_text(encoding="utf-8") if jinja.endswith(".jinja") and path.is_file() else jinja
    own = tokenizer.chat_template
    if isinstance(own, dict):
        own = own.get("default")
    fallback = None
    if name and name.startswith(FALLBACK_PREFIX):
        name, fallback = "tokenizer_default", name.removeprefix(FALLBACK_PREFIX)
    if name in (None, "tokenizer_default"):
        if own:
            return own
        if fallback is None:
            raise ValueError(
                f"{where}: the tokenizer has no chat template; set chat_template to one of "
                f"{', '.join(template_names())} (or chat_template_jinja to a Jinja template)"
            )
        name = fallback
    check_template_name(name, where)
    text = named_template(name)
    return own if own and own.strip() == text.strip() else text


def turn_tokens(template: str, eos: str | None, eot_tokens: tuple[str, ...] | None) -> list[str]:
    """The tokens that end a turn: the eos and ``eot_tokens``, those the template uses. With
    ``eot_tokens`` unset only the eos, as in Axolotl (a ChatML template under a base model's eos
    then trains no turn end: ``eot_warning`` says so before launch)."""
    candidates = (eos, *(eot_tokens or ()))
    return [
        t
        for t in dict.fromkeys(candidates)
        if t and (t in template or (t == eos and "eos_token" in template))
    ]


def eot_warning(template: str, eos: str | None, eot_tokens: tuple[str, ...] | None, where: str) -> str | None:
    """With ``eot_tokens`` unset and an eos the template does not use: the line saying that no turn
    end is trained (Axolotl's warning) and which ``eot_tokens`` would train it."""
    if eot_tokens or turn_tokens(template, eos, None):
        return None
    used = [t for t in TURN_TOKENS if t in template]
    fix = f"set eot_tokens: [{used[0]}] to train it" if used else "set eot_tokens to the template's turn end"
    return (
        f"{where}: eot_tokens is unset, so the turn end is the eos {eos!r}, which the chat template does "
        f"not use: no turn end is trained (as in Axolotl, which warns \"EOS token '{eos}' not found in "
        f"chat_template; the turn terminator won't be trained\"); {fix}"
    )


class ChatRenderer:
    """Renders one dataset's conversations into trained / untrained segments."""

    def __init__(
        self,
        tokenizer,
        template: str,
        spec: DatasetSpec,
        eot_tokens: tuple[str, ...] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        train_on_inputs: bool = False,
    ):
        for name in ("train_on_eos", "train_on_eot"):
            value = getattr(spec, name)
            if value not in TRAIN_ON_EOS and not (name == "train_on_eot" and value is None):
                raise ValueError(f"{name}: {value!r}; use one of {list(TRAIN_ON_EOS)}")
        self.tokenizer, self.template, self.spec = tokenizer, template, spec
        self.template_kwargs = dict(template_kwargs or {})
        self.role_names = dict(ROLE_NAMES)
        for target, sources in (spec.roles or {}).items():
            self.role_names.update(
                {str(s): str(target) for s in ([sources] if isinstance(sources, str) else sources)}
            )
        self.roles_to_train = {self.role_names.get(r, r) for r in spec.roles_to_train}
        self.train_on_inputs = train_on_inputs  # every role's turns trained (Axolotl's reading)
        self.thinking = (
            spec.field_thinking or "reasoning_content",
            spec.template_thinking_key or spec.field_thinking or "reasoning_content",
        )
        self.eos = eos = tokenizer.eos_token
        vocab = tokenizer.get_vocab()
        for t in eot_tokens or ():
            if t not in vocab:
                raise ValueError(
                    f"eot_tokens: {t!r} is not a token of the tokenizer (add it with tokens: [{t}])"
                )
        self.turn_tokens = turn_tokens(template, eos, eot_tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def messages(self, record: Mapping[str, Any], where: str) -> list[dict]:
        """The record's turns as ``[{"role", "content"}]`` (ShareGPT ``from``/``value`` accepted;
        the reasoning text under the template's key; system turns left out with
        ``drop_system_message``)."""
        spec = self.spec
        field = spec.field_messages or ("messages" if "messages" in record else "conversations")
        turns = record.get(field)
        if not isinstance(turns, list) or not turns:
            raise ValueError(
                f"{where}: column {field!r} must be a non-empty list of messages, got {_short(turns)}"
            )
        mapping = dict(spec.message_property_mappings or {})
        source, target = self.thinking
        out = []
        for i, m in enumerate(turns):
            if not isinstance(m, Mapping):
                raise ValueError(f"{where}: {field}[{i}] is not a message object: {_short(m)}")
            role_key = mapping.get("role") or ("from" if "from" in m and "role" not in m else "role")
            content_key = mapping.get("content") or (
                "value" if "value" in m and "content" not in m else "content"
            )
            role, content = m.get(role_key), m.get(content_key)
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(
                    f"{where}: {field}[{i}] needs a text {role_key!r} and {content_key!r}, got "
                    f"{_short(m)}; set message_property_mappings for other key names"
                )
            message = {"role": self.role_names.get(role, role), "content": content}
            if isinstance(m.get(source), str) and m.get(source):
                message[target] = m[source]
            if not (spec.drop_system_message and message["role"] == "system"):
                out.append(message)
        if not out:
            raise ValueError(f"{where}: no message left (drop_system_message removed every one)")
        return out

    def segments(self, record: Mapping[str, Any], where: str) -> list[Segment]:
        messages = self.messages(record, where)
        full = self.render(messages)
        ends = self._turn_ends(messages, full)
        if ends is None:  # the template renders a prefix differently (Qwen 3's thinking, an eos at the end)
            return self._searched(messages, full, where)
        segments: list[Segment] = []
        start = 0
        for i, (message, end) in enumerate(zip(messages, ends)):
            texts = [message["content"], message.get(self.thinking[1])] if self._trained(message) else []
            segments += self._turn(full[start:end], texts, self._end_policy(messages, i), where, i)
            start = end
        return segments

    def _trained(self, message: dict) -> bool:
        return self.train_on_inputs or message["role"] in self.roles_to_train

    def _end_policy(self, messages: list[dict], i: int) -> tuple[bool, bool]:
        """Whether turn ``i``'s end token is trained: (when it is the eos, when it is another token)."""
        policy = {
            "turn": self._trained(messages[i]),
            "all": True,
            "last": i == len(messages) - 1,
            "none": False,
        }
        return policy[self.spec.train_on_eos], policy[self.spec.train_on_eot or self.spec.train_on_eos]

    def _turn_ends(self, messages: list[dict], full: str) -> list[int] | None:
        """Where each turn ends: rendering ``messages[:i+1]`` gives a prefix of ``full`` (None when
        the template does not render prefixes as prefixes)."""
        ends = []
        for i in range(len(messages) - 1):
            prefix = self.render(messages[: i + 1])
            if not full.startswith(prefix):
                return None
            ends.append(len(prefix))
        return ends + [len(full)]

    def _searched(self, messages: list[dict], full: str, where: str) -> list[Segment]:
        """Turns located by finding each message's content, in order, in ``full``: the text between
        two contents is the next turn's header (never trained) after this turn's end token."""
        found = []
        pos = 0
        for i, message in enumerate(messages):
            content = message["content"]
            body = content if content in full[pos:] else content.strip()
            at = full.find(body, pos) if body else pos
            if at < 0:
                raise ValueError(
                    f"{where}: message {i}'s content is not in the chat template's output (the "
                    "template changes it); use another chat_template or type input_output"
                )
            found.append((at, at + len(body)))
            pos = at + len(body)
        segments: list[Segment] = []
        pos = 0
        for i, (message, (at, end)) in enumerate(zip(messages, found)):
            begin = at
            thinking = (message.get(self.thinking[1]) or "").strip() if self._trained(message) else ""
            if thinking and full.rfind(thinking, pos, at) >= 0:
                begin = full.rfind(thinking, pos, at)
            segments += [(full[pos:begin], False), (full[begin:end], self._trained(message) and end > begin)]
            limit = found[i + 1][0] if i + 1 < len(found) else len(full)
            hits = [(full.find(t, end, limit), t) for t in self.turn_tokens if full.find(t, end, limit) >= 0]
            pos = end
            if hits:
                hit, token = min(hits)
                flags = self._end_policy(messages, i)
                segments += [(full[end:hit], False), (token, flags[0] if token == self.eos else flags[1])]
                pos = hit + len(token)
        return [*segments, (full[pos:], False)]

    def _turn(
        self, turn: str, texts: list, end_trained: tuple[bool, bool], where: str, i: int
    ) -> list[Segment]:
        """Header (never trained), the trained text (``texts``: the content and the reasoning, from
        the first of them to the end of the content; none for an untrained turn), the text up to
        the turn token, the turn token (trained per ``end_trained``: (when it is the eos, when it
        is another end-of-turn token)), the rest."""
        limit = max((turn.rfind(t) for t in self.turn_tokens), default=-1)
        limit = len(turn) if limit < 0 else limit
        out: list[Segment] = [(turn[:limit], False)]
        tail = turn[limit:]
        if texts:
            content = texts[0]
            body = content if content in turn[:limit] else content.strip()
            pos = turn.rfind(body, 0, limit) if body else limit
            if pos < 0:
                raise ValueError(
                    f"{where}: message {i}'s content is not in the chat template's output (the "
                    "template changes it); use another chat_template or type input_output"
                )
            thinking = (texts[1] or "").strip()
            first = turn.rfind(thinking, 0, pos) if thinking else -1
            begin = first if first >= 0 else pos
            out = [(turn[:begin], False), (turn[begin : pos + len(body)], True)]
            tail = turn[pos + len(body) :]
        hits = [(tail.find(t), t) for t in self.turn_tokens if t in tail]
        if not hits:
            return [*out, (tail, False)]
        at, token = min(hits)
        flag = end_trained[0] if token == self.eos else end_trained[1]
        return [*out, (tail[:at], False), (token, flag), (tail[at + len(token) :], False)]
