"""The plugin against the installed SGLang's sources (no SGLang import): every module that binds
``get_kv_class`` by name is one the plugin rebinds, and the backend's SGLang names still exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kvpush.integrations.sglang import plugin


def _sglang_root(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip()) / "sglang"


def test_every_module_importing_get_kv_class_by_name_is_rebound(sglang_python: Path) -> None:
    root = _sglang_root(sglang_python)
    importers = set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if re.search(r"from sglang\.srt\.disaggregation\.utils import \([^)]*\bget_kv_class\b|"
                     r"from sglang\.srt\.disaggregation\.utils import [^\n(]*\bget_kv_class\b", text):
            importers.add(".".join(path.relative_to(root.parent).with_suffix("").parts))
    assert importers, "no importer found: the pattern no longer matches SGLang's sources"
    assert importers <= set(plugin.KV_CLASS_USERS), importers - set(plugin.KV_CLASS_USERS)


def test_the_names_the_backend_and_plugin_use_are_in_sglang(sglang_python: Path) -> None:
    root = _sglang_root(sglang_python)
    common = (root / "srt/disaggregation/common/conn.py").read_text()
    for name in ("class CommonKVManager", "class CommonKVSender", "class CommonKVReceiver",
                 "class CommonKVBootstrapServer", "ABORT_TAG =", "ABORT_ACK_TAG =", "class AbortNotification",
                 "def conclude_transfer", "def conclude_failure", "def apply_prefill_status",
                 "def parse_kv_status_message", "def _start_heartbeat_checker_thread", "def _prefill_unique_rank",
                 "def _room_notify_targets", "def send_kv_status_message", "def _maybe_ack_drained_abort",
                 "def register_deferred_ack_target"):
        assert name in common, name
    choices = (root / "srt/arg_groups/choices.py").read_text()
    assert "add_disagg_transfer_backend_choices" in choices
