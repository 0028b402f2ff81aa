"""``chat_template`` settings the data never meets, refused before tokenising: a role of
``roles_to_train`` (or a name of ``roles``) that no message has, a ``field_thinking`` key that no
message has. Each would train something else than its writer meant (nothing, or the answer
without its reasoning) without a word.

The check reads the Arrow schema and the distinct role values of the messages column (one pass in
C over the role strings, no Python per record); a column that is not a list of message structs
(mixed types) is left to the tokenising pass, which names the bad row.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc


def chat_problem(records, spec, role_names: dict[str, str], where: str) -> str | None:
    """One line naming the setting and the fix, or None. ``role_names``: data name -> template role
    (``ChatRenderer.role_names``)."""
    field = spec.field_messages or ("messages" if "messages" in records.column_names else "conversations")
    if field not in records.column_names:
        return None
    column = records.data.column(field)
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(
        kind.value_type
    ):
        return None
    keys = [f.name for f in kind.value_type]
    if spec.field_thinking and spec.field_thinking not in keys:
        return (
            f"{where}.field_thinking: no message of {spec.path!r} has the key {spec.field_thinking!r} (their "
            f"keys: {keys}); set it to the key holding the reasoning text, or remove it"
        )
    mapping = spec.message_property_mappings or {}
    role_key = mapping.get("role") or ("from" if "from" in keys and "role" not in keys else "role")
    content_key = mapping.get("content") or (
        "value" if "value" in keys and "content" not in keys else "content"
    )
    if role_key not in keys or content_key not in keys:
        return None  # malformed messages: the tokenising pass names the first one, row and index
    seen = set(
        pc.unique(
            pa.chunked_array(
                [c.flatten().field(role_key) for c in column.chunks],
                type=kind.value_type.field(role_key).type,
            )
        ).to_pylist()
    ) - {None}
    roles = sorted({role_names.get(r, r) for r in seen})
    untrained = [r for r in spec.roles_to_train if role_names.get(r, r) not in roles]
    if untrained:
        return (
            f"{where}.roles_to_train: {untrained} is a role no message of {spec.path!r} has (its roles: "
            f"{sorted(seen)}, read as {roles}); train roles the data has, or map its names with roles: "
            "{assistant: [...]}"
        )
    unused = [
        s
        for sources in (spec.roles or {}).values()
        for s in ([sources] if isinstance(sources, str) else sources)
        if s not in seen
    ]
    if unused:
        return (
            f"{where}.roles: {unused} is a role name no message of {spec.path!r} has (its roles: "
            f"{sorted(seen)}); map the names the data uses"
        )
    return None
