"""Secure defaults across real hosts (network namespaces the test makes): kvpush's own programs never
listen where other hosts reach them without a token, a stranger without the token cannot link to such a
listener, a wrong token fails the link with the reason in the listener's log, and the holder of the
right token links and pushes. The token travels in the environment (never on a command line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtest import Lines
from peer import Peer

from kvpush import AUTH_TOKEN_ENV, LLMStatusCode

KVPUSH = [sys.executable, "-m", "kvpush"]
LINK_FAILED = int(LLMStatusCode.LLM_LINK_FAILED)
SERVE_FLAGS = ["--layers", "2", "--blocks", "32", "--block-shape", "4,128", "--dtype", "int32", "--json"]


def _env(token: str | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != AUTH_TOKEN_ENV}
    if token is not None:
        env[AUTH_TOKEN_ENV] = token
    return env


@contextmanager
def _serving(wrapper: list[str], listen: str, token: str | None,
             *flags: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any], Lines]]:
    """``kvpush serve`` started and always ended: (process, its "listening" event, its stderr lines)."""
    proc = subprocess.Popen([*wrapper, *KVPUSH, "serve", "--listen", listen, *SERVE_FLAGS, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(token))
    try:
        listening = json.loads(Lines(proc).next())
        assert listening["event"] == "listening", listening
        yield proc, listening, Lines(proc, proc.stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_serve_refuses_to_listen_where_other_hosts_reach_it_without_a_token(two_hosts: Any) -> None:
    (ns_a, addr_a, _), _ = two_hosts
    for wrapper, listen in ((["ip", "netns", "exec", ns_a], f"{addr_a}:0"), ([], "0.0.0.0:0")):
        result = subprocess.run([*wrapper, *KVPUSH, "serve", "--listen", listen, *SERVE_FLAGS], capture_output=True,
                                text=True, timeout=60, env=_env(None))
        assert result.returncode == 1 and result.stdout == "", result
        assert AUTH_TOKEN_ENV in result.stderr and "--insecure" in result.stderr and listen in result.stderr
    # loopback needs no token; an explicit opt-out starts, saying so
    with _serving([], "127.0.0.1:0", None):
        pass
    with _serving(["ip", "netns", "exec", ns_a], f"{addr_a}:0", None, "--insecure") as (_, _, errors):
        assert "insecure" in errors.next()


def test_only_holders_of_the_token_link_to_a_listener_other_hosts_reach(two_hosts: Any) -> None:
    (ns_a, addr_a, _), (ns_b, _, _) = two_hosts
    with _serving(["ip", "netns", "exec", ns_a], f"{addr_a}:0", "the-deployment-secret") as (_, listening, errors):
        port = listening["port"]
        for token, expected in ((None, LINK_FAILED), ("a-guess", LINK_FAILED)):
            options = {} if token is None else {"kvpush.auth_token": token}
            with Peer(66, options=options, role=1, wrapper=["ip", "netns", "exec", ns_b]) as stranger:
                linked = stranger.call("link", cluster_id=2, host=addr_a, port=port)
                assert linked["codes"] == [expected], (token, linked)
        refusals = [errors.next(), errors.next()]
        assert all("refused a link" in line for line in refusals), refusals
        assert any("auth" in line.lower() for line in refusals), refusals
        pushed = subprocess.run(["ip", "netns", "exec", ns_b, *KVPUSH, "push", "--to", f"{addr_a}:{port}", "--blocks",
                                 "4", "--json"], capture_output=True, text=True, timeout=60,
                                env=_env("the-deployment-secret"))
        assert pushed.returncode == 0, pushed.stderr
        assert json.loads(pushed.stdout)["verified"] is True
