"""The command line as a whole (issue #22, the app-level parts), run as a user runs it: --version, -h,
shell completion, start-up without torch, the bundled model by name, install hints that keep their
brackets, bpb's plot flags (old and new forms, matplotlib checked before the run) and convert's --resume
hint when it leaves a partial destination. Start-up (--version, what is imported), shell completion and Ctrl-C
are checked on the command in a subprocess; most messages, exit codes, outputs and files through the command's
entry point in this process (`run_here`), which spares the interpreter's start and torch's import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "model" / "assets" / "dsv41-tiny"


def dsv41(*args, cwd=ROOT, env_extra=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSV41_THREADS": "1", **(env_extra or {})}
    if "DSV41_MODEL" not in (env_extra or {}):
        env.pop("DSV41_MODEL", None)
    return subprocess.run([sys.executable, "-m", "dsv41_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


@pytest.fixture
def run_here(run_here):
    """conftest's `run_here` (the command in this process) as `dsv41()` runs it: DSV41_THREADS=1, no DSV41_MODEL
    unless given (env_extra), in `cwd`."""

    def run(*args, cwd=ROOT, env_extra=None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "DSV41_MODEL"}
        return run_here(*args, env={**env, "DSV41_THREADS": "1", **(env_extra or {})}, cwd=cwd)

    return run


def hide(tmp_path: Path, *modules: str) -> dict:
    """PYTHONPATH with a folder first whose modules fail to import, as if their extra were not installed."""
    d = tmp_path / "hide"
    d.mkdir(exist_ok=True)
    for m in modules:
        (d / f"{m}.py").write_text(f"raise ImportError('{m} hidden by the test')\n")
    return {"PYTHONPATH": f"{d}{os.pathsep}{ROOT}"}


# ------------------------------------------------------------------------------------ flags of the app
def test_version():
    r = dsv41("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"dsv41 {version('dsv41')}", r.stderr


@pytest.mark.parametrize("command", [[], ["info"], ["bpb"], ["quantize-kv"], ["convert"], ["generate"]])
def test_h_is_help(command, run_here):
    short, long = run_here(*command, "-h"), run_here(*command, "--help")
    assert short.returncode == 0 and long.returncode == 0, short.stderr
    assert short.stdout == long.stdout and "Usage: dsv41" in short.stdout
    if command and command[0] in ("info", "bpb", "quantize-kv", "convert"):  # mine: examples at the end
        tail = short.stdout[short.stdout.index("Examples:"):]
        assert f"dsv41 {command[0]} " in tail


def test_completion_flags_listed(run_here):
    r = run_here("--help")
    assert r.returncode == 0
    assert "--install-completion" in r.stdout and "--show-completion" in r.stdout and "--version" in r.stdout
    for name in ("info", "generate", "convert", "eval", "bpb", "effort-sweep", "scaffold-bench", "quantize-kv"):
        assert name in r.stdout


def test_completion_script_and_command_names():
    # typer takes the shell named after --show-completion only with its detection off; with it on, it asks
    # shellingham, which walks the process tree and finds no shell under a runner started without one (nohup)
    r = dsv41("--show-completion", "bash",
              env_extra={"SHELL": "/bin/bash", "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert r.returncode == 0 and "_DSV41_COMPLETE" in r.stdout, r.stderr
    env = {"_DSV41_COMPLETE": "complete_bash", "COMP_WORDS": "dsv41 qu", "COMP_CWORD": "1"}
    r = dsv41(env_extra=env)
    assert "quantize-kv" in r.stdout, (r.stdout, r.stderr)


def test_help_and_print_prompt_start_without_torch():
    """--help imports no command module and no torch; generate --print-prompt needs no torch either."""
    code = ("import sys; from dsv41_cli.app import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "mods = [m for m in sys.modules if m == 'torch' or m.startswith('dsv41_cli.commands.')]\n"
            "print('LOADED', sorted(mods), file=sys.stderr)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert "LOADED ['dsv41_cli.commands']" in r.stderr or "LOADED []" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", code, "generate", "--print-prompt", "hi"], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    assert "<｜User｜>hi" in r.stdout and "'torch'" not in r.stderr, r.stderr


def test_info_builds_no_dynamo():
    code = ("import sys; from dsv41_cli.app import main\n"
            "try:\n    main(['info', '--json'])\nexcept SystemExit:\n    pass\n"
            "print('DYNAMO', 'torch._dynamo' in sys.modules, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert json.loads(r.stdout)["params"] and "DYNAMO False" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------ the bundled model by name
def test_model_dsv41_tiny_by_name_and_env(tmp_path, run_here):
    by_flag = run_here("info", "--model", "dsv41-tiny", "--json", cwd=tmp_path)
    by_env = run_here("info", "--json", cwd=tmp_path, env_extra={"DSV41_MODEL": "dsv41-tiny"})
    default = run_here("info", "--json", cwd=tmp_path)
    for r in (by_flag, by_env, default):
        assert r.returncode == 0, r.stderr
        assert Path(json.loads(r.stdout)["path"]).resolve() == BUNDLED.resolve()
    assert json.loads(by_flag.stdout) == json.loads(default.stdout) == json.loads(by_env.stdout)
    text = run_here("info", "--model", "dsv41-tiny", cwd=tmp_path)
    assert text.returncode == 0
    assert f"path: {BUNDLED}" in text.stdout and "(dsv41-tiny, bundled)" in text.stdout
    missing = run_here("info", "--model", "dsv41-tinyy", cwd=tmp_path)
    assert missing.returncode == 2 and "dsv41-tiny" in missing.stderr and len(missing.stderr.splitlines()) == 1


def test_generate_print_prompt_with_model_name(tmp_path, run_here):
    r = run_here("generate", "--print-prompt", "--model", "dsv41-tiny", "hi", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.endswith("<think>"), r.stderr


# ------------------------------------------------------------------------------------ install hints
def test_plot_without_matplotlib_fails_before_the_run_with_the_hint(tmp_path, run_here, monkeypatch):
    corpus = tmp_path / "t.txt"
    corpus.write_text("some text to score")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails here, as if it were not installed
    for args in (["--plot"], ["--plot-file", tmp_path / "f.svg"], ["--plot", tmp_path / "f.png"]):
        started = time.monotonic()
        r = run_here("bpb", corpus, *args, cwd=tmp_path)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line, no progress: no run started
        assert "pip install 'dsv41[plots]'" in r.stderr, r.stderr
        assert not (tmp_path / "bpb.png").exists() and not (tmp_path / "f.svg").exists()
        assert time.monotonic() - started < 60


def test_effort_sweep_hint_keeps_brackets(tmp_path):
    r = dsv41("effort-sweep", "--limit", "1", "--efforts", "low", "--output", tmp_path / "o", cwd=tmp_path,
              env_extra=hide(tmp_path, "matplotlib"))
    assert r.returncode == 2 and "pip install 'dsv41[plots]'" in r.stderr and "\\[" not in r.stderr, r.stderr


def test_fail_prints_brackets_and_unescapes():
    code = ("from dsv41_cli.console import fail, install_hint\n"
            "from rich.markup import escape\n"
            "import sys\n"
            "try:\n    fail(sys.argv[1] + ' ' + install_hint('eval'))\nexcept BaseException:\n    pass\n"
            "try:\n    fail(escape(\"x needs y: pip install 'dsv41[plots]'\"))\n"
            "except BaseException as e:\n    sys.exit(e.exit_code)")
    r = subprocess.run([sys.executable, "-c", code, "[bold]lit[/]"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "40"})
    lines = r.stderr.splitlines()
    assert r.returncode == 2
    assert lines == ["dsv41: error: [bold]lit[/] pip install 'dsv41[eval]'",
                     "dsv41: error: x needs y: pip install 'dsv41[plots]'"], lines


# ------------------------------------------------------------------------------------ bpb plot flags
@pytest.mark.skipif(pytest.importorskip("matplotlib") is None, reason="needs matplotlib")
def test_bpb_plot_flags_old_and_new_forms(tmp_path, run_here):
    corpus = tmp_path / "t.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\n")
    common = ["--bootstrap", "0", "--baselines", "gzip"]
    old = run_here("bpb", corpus, "--plot", tmp_path / "old.png", *common, cwd=tmp_path)  # the old form
    assert old.returncode == 0, old.stderr
    assert (tmp_path / "old.png").stat().st_size > 0 and "overall" in old.stdout
    new = run_here("bpb", corpus, "--plot-file", tmp_path / "new.svg", "--json", *common, cwd=tmp_path)
    assert new.returncode == 0, new.stderr
    assert (tmp_path / "new.svg").read_text().lstrip().startswith("<?xml") and json.loads(new.stdout)["models"]
    bare = run_here("bpb", corpus, "--plot", *common, cwd=tmp_path)  # --plot alone: bpb.png here
    assert bare.returncode == 0 and (tmp_path / "bpb.png").is_file(), bare.stderr
    (tmp_path / "bpb.png").unlink()
    off = run_here("bpb", corpus, "--no-plot", *common, cwd=tmp_path)
    assert off.returncode == 0 and not (tmp_path / "bpb.png").exists()


def test_bpb_legacy_rewrite():
    from dsv41_cli.app import rewrite_legacy_args as rw

    assert rw(["bpb", "c.txt", "--plot", "f.png", "--json"]) == ["bpb", "c.txt", "--plot-file", "f.png", "--json"]
    assert rw(["bpb", "--plot=f.pdf", "c.txt"]) == ["bpb", "--plot-file=f.pdf", "c.txt"]
    assert rw(["bpb", "--plot", "c.txt"]) == ["bpb", "--plot", "c.txt"]  # a corpus after the bool flag
    assert rw(["bpb", "--", "--plot", "f.png"]) == ["bpb", "--", "--plot", "f.png"]
    assert rw(["generate", "--plot", "f.png"]) == ["generate", "--plot", "f.png"]


# ------------------------------------------------------------------------------------ convert: --resume hint
@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    from dsv41.model.fixtures import write_official_fixture

    return write_official_fixture(tmp_path_factory.mktemp("ckpt") / "official", seed=2)


# the command with every fsync slowed down, so that the conversion is still running when Ctrl-C comes
SLOW_FSYNC = ("import os, sys, time; _fsync = os.fsync\n"
              "def fsync(fd):\n"
              "    time.sleep(0.3); return _fsync(fd)\n"
              "os.fsync = fsync\n"
              "from dsv41_cli.app import main; main(sys.argv[1:])")


def test_convert_interrupted_names_resume(official, tmp_path):
    from dsv41.model import checkpoint as C

    dst = tmp_path / "dst"
    partial = C.partial_dir(dst)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_FSYNC, "convert", str(official), str(dst), "--mp", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (partial / C.JOURNAL_FILE).exists():
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the conversion finished before it could be interrupted"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("dsv41: interrupted") and "--resume" in last and str(partial) in last, err
    assert partial.is_dir() and not dst.exists()


def test_convert_disk_error_names_resume(official, tmp_path, run_here, monkeypatch):
    calls = [0]
    fsync = os.fsync

    def full_disk(fd):  # the second fsync finds the disk full
        calls[0] += 1
        if calls[0] >= 2:
            raise OSError(28, "No space left on device")
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    r = run_here("convert", official, tmp_path / "dst", "--mp", "2")
    assert calls[0] >= 2 and r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("dsv41: error:") and "No space left" in last and "--resume" in last, r.stderr


def test_a_long_usage_error_is_one_line(run_here):
    """Click's messages for a bad flag value run past 80 columns; the error line is never wrapped."""
    r = run_here("generate", "--max-new-tokens", "-3", "hi")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "dsv41: error: Invalid value for '--max-new-tokens': Input should be greater than or equal to 1"]
