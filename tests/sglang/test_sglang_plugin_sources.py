"""The plugin against the installed SGLang's sources (no SGLang import): every module that binds
``get_kv_class`` by name is one the plugin rebinds, and the backend's SGLang names still exist."""

from __future__ import annotations

import os
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


def test_the_benchmarks_mooncake_shim_turns_off_what_sglang_asks(sglang_python: Path) -> None:
    """bench/sglang_bench.py runs SGLang's own ``mooncake_tcp`` on this CUDA-less host with a test-only shim
    (tests/sglang/mooncake_cpu/sitecustomize.py): the prefill's CUDA calls sit behind one class attribute of
    Mooncake's sender. The attribute must still be what SGLang asks, and the shim must be what turns it off."""
    root = _sglang_root(sglang_python)
    assert 'getattr(sender, "supports_host_tensor_indices", False)' in (
        root / "srt/disaggregation/prefill.py").read_text()
    shim = Path(__file__).resolve().parent / "mooncake_cpu"
    probe = ("import sglang.srt.disaggregation.mooncake.conn as conn; "
             "print(conn.MooncakeKVSender.supports_host_tensor_indices)")
    answers = [subprocess.run([str(sglang_python), "-c", probe], check=True, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": path}, timeout=300).stdout.split()[-1]
               for path in ("", str(shim))]
    assert answers == ["True", "False"]
