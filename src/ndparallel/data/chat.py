"""``type: chat_template``: a conversation rendered with a chat template, split into trained and
untrained text.

The template is the tokenizer's own (``tokenizer_default``), a built-in one (``chatml``,
``llama3``) or a Jinja string. Turn boundaries come from the template itself: turn ``i`` is the
text that rendering ``messages[:i+1]`` adds to rendering ``messages[:i]`` (a template must render
a conversation's prefix as a prefix of its text; one that does not is refused with the row
named). Inside a turn, the message content is trained when its role is in ``roles_to_train``
(default ``["assistant"]``); the role header never is; the end-of-turn token (the eos, or a
turn token the template uses such as ``<|eot_id|>``/``<|im_end|>``) per ``train_on_eos``:
``turn`` (of trained turns, the default), ``all``, ``last`` (the last turn's), ``none`` — and
``train_on_eot`` for an end-of-turn token that is not the eos (default: as ``train_on_eos``);
``eot_tokens`` (the run's) replaces the detected turn tokens.
``train_on_inputs: true`` trains everything instead (``encode.py``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .dataset import DatasetSpec
from .prompts import Segment, _short

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
"""Built-in templates by name (as Axolotl's ``chat_template:`` names them)."""
TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")
ROLE_NAMES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
"""ShareGPT-style role names -> the chat-template ones."""
TRAIN_ON_EOS = ("turn", "all", "last", "none")


def resolve_template(tokenizer, name: str | None, jinja: str | None, where: str) -> str:
    """The Jinja text of the template to use (``name`` None = the tokenizer's own)."""
    if jinja:
        return jinja
    fallback = None
    if name and name.startswith("tokenizer_default_fallback_"):
        name, fallback = "tokenizer_default", name.removeprefix("tokenizer_default_fallback_")
    if name in (None, "tokenizer_default"):
        own = tokenizer.chat_template
        if isinstance(own, dict):
            own = own.get("default")
        if own:
            return own
        if fallback is None:
            raise ValueError(f"{where}: the tokenizer has no chat template; set chat_template to one of "
                             f"{sorted(TEMPLATES)} (or chat_template_jinja to a Jinja template)")
        name = fallback
    if name not in TEMPLATES:
        raise ValueError(f"{where}.chat_template: unknown template {name!r}; use tokenizer_default, one of "
                         f"{sorted(TEMPLATES)}, or chat_template_jinja")
    return TEMPLATES[name]


class ChatRenderer:
    """Renders one dataset's conversations into trained / untrained segments."""

    def __init__(self, tokenizer, template: str, spec: DatasetSpec, eot_tokens: tuple[str, ...] | None = None):
        for name in ("train_on_eos", "train_on_eot"):
            value = getattr(spec, name)
            if value not in TRAIN_ON_EOS and not (name == "train_on_eot" and value is None):
                raise ValueError(f"{name}: {value!r}; use one of {list(TRAIN_ON_EOS)}")
        self.tokenizer, self.template, self.spec = tokenizer, template, spec
        self.roles_to_train = {ROLE_NAMES.get(r, r) for r in spec.roles_to_train}
        self.eos = eos = tokenizer.eos_token
        vocab = tokenizer.get_vocab()
        for t in eot_tokens or ():
            if t not in vocab:
                raise ValueError(f"eot_tokens: {t!r} is not a token of the tokenizer (add it with tokens: [{t}])")
        candidates = (eos, *eot_tokens) if eot_tokens else (eos, *TURN_TOKENS)
        self.turn_tokens = [t for t in dict.fromkeys(candidates)
                            if t and (t in template or (t == eos and "eos_token" in template))]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def messages(self, record: Mapping[str, Any], where: str) -> list[dict]:
        """The record's turns as ``[{"role", "content"}]`` (ShareGPT ``from``/``value`` accepted)."""
        spec = self.spec
        field = spec.field_messages or ("messages" if "messages" in record else "conversations")
        turns = record.get(field)
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: column {field!r} must be a non-empty list of messages, got {_short(turns)}")
        mapping = dict(spec.message_property_mappings or {})
        out = []
        for i, m in enumerate(turns):
            if not isinstance(m, Mapping):
                raise ValueError(f"{where}: {field}[{i}] is not a message object: {_short(m)}")
            role_key = mapping.get("role") or ("from" if "from" in m and "role" not in m else "role")
            content_key = mapping.get("content") or ("value" if "value" in m and "content" not in m else "content")
            role, content = m.get(role_key), m.get(content_key)
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(f"{where}: {field}[{i}] needs a text {role_key!r} and {content_key!r}, got "
                                 f"{_short(m)}; set message_property_mappings for other key names")
            out.append({"role": ROLE_NAMES.get(role, role), "content": content})
        return out

    def segments(self, record: Mapping[str, Any], where: str) -> list[Segment]:
        messages = self.messages(record, where)
        full = self.render(messages)
        segments: list[Segment] = []
        start = 0
        for i, message in enumerate(messages):
            end = len(full)
            if i < len(messages) - 1:
                prefix = self.render(messages[: i + 1])
                if not full.startswith(prefix):
                    raise ValueError(f"{where}: the chat template does not render the conversation's first {i + 1} "
                                     "message(s) as a prefix of the whole (turns cannot be located); use another "
                                     "chat_template, or type input_output with explicit segments")
                end = len(prefix)
            trained = message["role"] in self.roles_to_train
            policy = {"turn": trained, "all": True, "last": i == len(messages) - 1, "none": False}
            end_trained = (policy[self.spec.train_on_eos], policy[self.spec.train_on_eot or self.spec.train_on_eos])
            segments += self._turn(full[start:end], message["content"], trained, end_trained, where, i)
            start = end
        return segments

    def _turn(self, turn: str, content: str, trained: bool, end_trained: tuple[bool, bool], where: str,
              i: int) -> list[Segment]:
        """Header (never trained), content, text up to the turn token, the turn token (trained per
        ``end_trained``: (when it is the eos, when it is another end-of-turn token)), the rest."""
        limit = max((turn.rfind(t) for t in self.turn_tokens), default=-1)
        limit = len(turn) if limit < 0 else limit
        body = content if content in turn[:limit] else content.strip()
        pos = turn.rfind(body, 0, limit) if body else limit
        if pos < 0:
            raise ValueError(f"{where}: message {i}'s content is not in the chat template's output (the template "
                             "changes it); use another chat_template or type input_output")
        out: list[Segment] = [(turn[:pos], False), (body, trained)]
        tail = turn[pos + len(body):]
        hits = [(tail.find(t), t) for t in self.turn_tokens if t in tail]
        if not hits:
            return [*out, (tail, False)]
        at, token = min(hits)
        flag = end_trained[0] if token == self.eos else end_trained[1]
        return [*out, (tail[:at], False), (token, flag), (tail[at + len(token):], False)]
