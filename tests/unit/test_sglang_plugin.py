"""kvpush.integrations.sglang: the plugin's two moves on SGLang's objects, on stand-ins of the same kind (the
real ones are exercised by tests/sglang)."""

from __future__ import annotations

import enum

from kvpush.integrations.sglang import plugin


class Backend(enum.Enum):
    MOONCAKE = "mooncake"


def test_a_new_member_behaves_as_a_built_one_and_is_added_once() -> None:
    member = plugin.add_enum_member(Backend, "KVPUSH", "kvpush")
    assert Backend("kvpush") is member is Backend.KVPUSH  # type: ignore[attr-defined]
    assert isinstance(member, Backend) and member.value == "kvpush" and member.name == "KVPUSH"
    assert {member: 1}[Backend("kvpush")] == 1 and Backend("mooncake") is Backend.MOONCAKE
    assert plugin.add_enum_member(Backend, "KVPUSH", "kvpush") is member
    assert [m.value for m in Backend] == ["mooncake", "kvpush"]


def test_get_kv_class_answers_for_kvpush_and_passes_the_others_through_once_wrapped() -> None:
    calls = []

    def original(backend: object, class_type: object) -> object:
        calls.append((backend, class_type))
        return "sglang's"

    wrapped = plugin.wrap_get_kv_class(original)
    assert plugin.wrap_get_kv_class(wrapped) is wrapped  # registering twice wraps once
    assert wrapped(Backend.MOONCAKE, "manager") == "sglang's" and calls == [(Backend.MOONCAKE, "manager")]
    member = plugin.add_enum_member(Backend, "KVPUSH", "kvpush")
    resolved: list[object] = []
    plugin_kv_class, plugin.kv_class = plugin.kv_class, lambda class_type: resolved.append(class_type) or object
    try:
        assert wrapped(member, "sender") is object and resolved == ["sender"] and len(calls) == 1
    finally:
        plugin.kv_class = plugin_kv_class
