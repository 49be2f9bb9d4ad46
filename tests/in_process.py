"""`dsv41 ARGV` in the test process: for the tests of a command's messages, exit codes, output and files, where a
process of its own would spend seconds starting the interpreter and importing torch before the command runs.
Tests of signals, terminals, stdin pipes and process exit start real processes."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch


def run_dsv41(*argv, input: str = "", env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """The command through the entry point `python -m dsv41_cli` calls (dsv41_cli.app.main), as a CompletedProcess
    of its exit code, stdout and stderr. stdin is `input`; `env`, when given, is the whole environment while the
    command runs; `cwd` where it runs. What a command changes in this process is put back: torch's threads (a
    command that loads a model sets them, dsv41_cli.common.tune_threads), the environment (eval's offline and
    progress-bar flags), the working directory and stdin."""
    from dsv41_cli.app import main

    stdout, stderr = io.StringIO(), io.StringIO()
    environ, threads, here, stdin = dict(os.environ), torch.get_num_threads(), os.getcwd(), sys.stdin
    try:
        sys.stdin = io.TextIOWrapper(io.BytesIO(input.encode()))
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                pytest.raises(SystemExit) as stop:
            main([str(a) for a in argv])
    finally:
        sys.stdin = stdin
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(argv, stop.value.code, stdout.getvalue(), stderr.getvalue())
