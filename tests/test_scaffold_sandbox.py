"""The command jail of scaffold-bench.

First harmless probes show what the jail can see and write (only the workspace, a capped /tmp and
/dev/shm, device nodes). Only then hostile commands run: reading and writing outside the episode,
`rm -rf /` and `rm -rf ~`, connections to a listener on the host's 127.0.0.1, fork bombs, endless
loops, gigabytes of output, huge files and memory. Each must be contained, leave the host as it was,
end with the episode reported as failed, and leave the bench running (the next task still passes).

The jail needs bubblewrap (`.ci/deps-scaffold.sh` installs it). Without it these tests fail, on
purpose; set DSV41_SKIP_JAIL_TESTS=1 to skip them on a machine that cannot have it.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dsv41.evals.scaffolds.actions import ToolCall, write_action
from dsv41.evals.scaffolds.bench import run_bench
from dsv41.evals.scaffolds.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from dsv41.evals.scaffolds.scaffold import load_scaffold
from dsv41.evals.scaffolds.tasks import load_tasks

# wall_seconds: what the hostile commands that do not end (sleeper, fork bomb, rm -rf /) are given; the harmless
# commands of these tests take at most about 0.1 s each on an idle 2-core CPU
FAST = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, memory_bytes=512 << 20, max_processes=48,
                     max_output_bytes=256 << 10, workspace_bytes=32 << 20, workspace_files=2_000,
                     tmp_bytes=16 << 20, max_file_bytes=16 << 20)


@pytest.fixture(scope="module")
def jail() -> Sandbox:
    sandbox = Sandbox(FAST)
    try:
        sandbox.check()
    except SandboxUnavailable as e:
        if os.environ.get("DSV41_SKIP_JAIL_TESTS"):
            pytest.skip(f"jail unavailable: {e}")
        pytest.fail(f"the command jail cannot be set up here ({e}); run .ci/deps-scaffold.sh")
    return sandbox


# ---------------------------------------------------------------------------------------------
# Harmless probes first: what the jail sees and may write
# ---------------------------------------------------------------------------------------------


def test_probe_only_the_workspace_tmp_and_devices_are_writable(jail):
    """What a command in the jail may write, found without walking the whole file system (a `find /` over
    the host's /usr outlasts the jail's one CPU-second on a large host). A file can be writable only on a
    mount that is mounted read-write (access(2) answers EROFS on every read-only mount, whatever the file's
    mode), so the probe lists the jail's mounts from /proc/self/mountinfo, requires every read-write one to
    be an allowed place, and walks only those (each with -xdev) for writable entries."""
    with jail.episode() as episode:
        result = episode.run(
            "awk '{print $5, $6}' /proc/self/mountinfo; echo MOUNTS;"
            "for m in $(awk '$6 ~ /(^|,)rw(,|$)/ && $5 != \"/proc\" {print $5}' /proc/self/mountinfo); do "
            "find \"$m\" -xdev -writable 2>/dev/null; done; echo END")
    lines = result.output.split("\n")
    assert "MOUNTS" in lines and "END" in lines, result.output[-400:]
    mounts = [line.split(" ", 1) for line in lines[:lines.index("MOUNTS")]]
    writable = [p for p in lines[lines.index("MOUNTS") + 1:lines.index("END")] if p]
    allowed_prefixes = ("/workspace", "/tmp", "/dev/shm", "/dev/pts")
    devices = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx",
               "/dev/fd", "/dev/stdin", "/dev/stdout", "/dev/stderr"}
    rw_mounts = [point for point, options in mounts if "rw" in options.split(",")]
    assert {"/", "/usr", "/etc"} <= {point for point, _ in mounts}  # the walk saw the whole mount table
    for point in rw_mounts:
        assert point == "/proc" or point.startswith(allowed_prefixes) or point in devices, \
            f"mounted read-write in the jail: {point}"
    for path in writable:
        target = os.path.realpath(path) if path.startswith("/usr/lib/systemd") else path  # masked units -> /dev/null
        assert target.startswith(allowed_prefixes) or target in devices, f"writable in the jail: {path}"
    assert "/workspace" in writable and "/tmp" in writable


def test_probe_identity_network_and_host_paths(jail):
    with jail.episode() as episode:
        result = episode.run(
            "id -u; grep CapEff /proc/self/status; tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ';"
            "ls -d /root /home /work /var /srv /opt 2>&1 | grep -c 'No such file';"
            "echo $HOME; pwd; ulimit -t; ulimit -v; ulimit -u; ulimit -f; ulimit -n"
        )
    lines = result.output.split("\n")
    assert lines[0] != "0"  # not root inside
    assert lines[1].endswith("0000000000000000")  # no capabilities
    assert lines[2] == "lo" and lines[3] == "6"  # only the jail's own loopback; no host directories
    assert lines[4:6] == ["/workspace", "/workspace"]
    assert lines[6:11] == [str(FAST.cpu_seconds), str(FAST.memory_bytes // 1024), str(FAST.max_processes),
                           str(FAST.max_file_bytes // 1024), str(FAST.max_open_files)]


def test_episode_directory_is_removed_even_when_made_hostile(jail):
    with jail.episode() as episode:
        root = episode.root
        episode.run("mkdir -p a/b && touch a/b/f && chmod 000 a/b && chmod 555 a && mkfifo pipe && ln -s / rootlink")
        assert root.is_dir()
    assert not root.exists()


def test_refuses_without_bubblewrap(tmp_path):
    sandbox = Sandbox(FAST, bwrap=str(tmp_path / "no-such-bwrap"), base_dir=tmp_path)
    with pytest.raises(SandboxUnavailable, match="not installed"):
        sandbox.check()
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable):
        with sandbox.episode() as episode:
            episode.run(f"touch {marker}")
    assert not marker.exists()


@pytest.fixture
def public_dir():
    """A directory every user can read (the jail's host user is `nobody` when we are root)."""
    path = Path(tempfile.mkdtemp(prefix="dsv41-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_refuses_a_jail_that_does_not_confine(public_dir):
    """A 'bwrap' that just runs the command unconfined must be caught by the probe, and the bench
    must then refuse to run anything (no backend call, no command)."""
    fake = public_dir / "fake-bwrap"
    fake.write_text(textwrap.dedent("""\
        #!/bin/sh
        if [ "$1" = "--help" ]; then echo "usage: bwrap [OPTIONS...] [--] COMMAND"; exit 0; fi
        while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done
        shift
        exec "$@"
    """))
    fake.chmod(0o755)
    sandbox = Sandbox(FAST, bwrap=str(fake))
    with pytest.raises(SandboxUnavailable, match="did not confine"):
        sandbox.check()

    class Recorder:
        name = "recorder"
        calls = 0

        def chat(self, messages, tools, effort):
            Recorder.calls += 1
            return "", 0

    tasks, _ = load_tasks()
    with pytest.raises(SandboxUnavailable):
        run_bench(Recorder(), [load_scaffold("xml")], tasks[:1], [], [75], sandbox)
    assert Recorder.calls == 0


# ---------------------------------------------------------------------------------------------
# Hostile commands, run through the bench: contained, host untouched, episode failed, bench goes on
# ---------------------------------------------------------------------------------------------


class Scripted:
    """Plays a fixed list of commands per task (then submits) in the scaffold's own format."""

    name = "scripted"

    def __init__(self, scripts: dict[str, list[str]]):
        self.scripts = scripts

    def begin(self, task, scaffold):
        self.scaffold = scaffold
        self.queue = list(self.scripts[task.id]) + [f"echo {scaffold.submit_sentinel}"]

    def chat(self, messages, tools, effort):
        command = self.queue.pop(0) if self.queue else f"echo {self.scaffold.submit_sentinel}"
        text = write_action(self.scaffold.action_format, [ToolCall("bash", {"command": command}, "call_0")], "thinking",
                            thought="scripted", options=self.scaffold.action_options)
        return text, 1


def _make_task(root: Path, name: str) -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "instruction.md").write_text("Create done.txt.\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n[ -f done.txt ]\n")
    return task


def _snapshot(paths: list[Path]) -> dict:
    state = {}
    for base in paths:
        for p in [base, *base.rglob("*")] if base.is_dir() else [base]:
            st = os.lstat(p)
            state[str(p)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns,
                             p.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return state


def _live_processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.fixture
def host(tmp_path):
    """Canaries on the host, outside any episode, and a listener on the host's loopback."""
    canary_dir = tmp_path / "host"
    canary_dir.mkdir()
    (canary_dir / "canary.txt").write_text("SECRET-CANARY-4711\n")
    (canary_dir / "sub").mkdir()
    (canary_dir / "sub" / "keep.txt").write_text("keep\n")
    os.chmod(tmp_path, 0o755)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    accepted: list = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                accepted.append(conn.recv(100))
                conn.close()
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    home = Path.home()
    watched = [canary_dir]
    before = _snapshot(watched)
    home_before = sorted(os.listdir(home))
    system_before = {d: sorted(os.listdir(d)) for d in ("/etc", "/usr/bin")}
    yield {"dir": canary_dir, "canary": canary_dir / "canary.txt", "port": server.getsockname()[1],
           "accepted": accepted, "root": tmp_path}
    stop.set()
    thread.join()
    server.close()
    assert _snapshot(watched) == before, "a host file outside the episode changed"
    assert sorted(os.listdir(home)) == home_before
    for d, listing in system_before.items():
        assert sorted(os.listdir(d)) == listing, f"{d} changed"


HOSTILE = {
    "read-outside": "cat {canary}; ls {dir}; cat /etc/shadow; ls /root /home /work; cat ../../canary.txt",
    "write-outside": "echo pwned > {canary}; touch /usr/bin/dsv41-evil /etc/dsv41-evil /dsv41-evil {dir}/new;"
                     " ln -s {dir} link; echo x > link/new2; ls /; exit 0",
    "rm-rf-root": "rm -rf / ; rm -rf --no-preserve-root / 2>/dev/null; rm -rf /* 2>/dev/null; ls -A /workspace; exit 0",
    "rm-rf-home": "cd ~ && rm -rf ~ ; rm -rf $HOME/.. ; echo still here",
    "network": "echo hello > /dev/tcp/127.0.0.1/{port}; python3 -c \"import socket; "
               "socket.create_connection(('127.0.0.1', {port}), timeout=1)\"; "
               "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)\"; exit 0",
    "fork-bomb": ":(){{ :|:& }};: ; sleep 1 # {mark}",  # ends normally, its bomb still running
    "fork-bomb-foreground": "bomb() {{ bomb | bomb; }}; bomb # {mark}",
    "endless-loop": "while :; do :; done # {mark}",
    "sleeper": "exec -a {mark} sleep 600",
    "output-flood": "exec -a {mark} yes dsv41-flood",
    "binary-flood": "exec -a {mark} head -c 4G /dev/zero",
    "big-file": "head -c 1G /dev/zero > big.bin",
    "many-files": "for i in $(seq 1 200); do head -c 1M /dev/zero > f$i.bin || break; done",
    "memory": "python3 -c 'x = bytearray(4 << 30)'",
    "background-daemon": "( exec -a {mark} sleep 600 ) >/dev/null 2>&1 & disown; echo started",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_command_is_contained(jail, host, tmp_path, name):
    mark = f"dsv41-hostile-{name}-{os.getpid()}"
    command = HOSTILE[name].format(canary=host["canary"], dir=host["dir"], port=host["port"], mark=mark)
    tasks_dir = tmp_path / "tasks"
    _make_task(tasks_dir, "a-hostile")
    greeting = next(t for t in load_tasks()[0] if t.id == "create-greeting")
    hostile_task = load_tasks(tasks_dir)[0][0]
    scripts = {"a-hostile": [command, "echo alive"], "create-greeting": greeting.solution_steps()}
    started = time.monotonic()
    report = run_bench(Scripted(scripts), [load_scaffold("backticks")], [hostile_task, greeting], [], [75], jail)
    elapsed = time.monotonic() - started
    hostile, normal = report["episodes"]
    assert not hostile["passed"], "the hostile episode must be reported as failed"
    assert normal["passed"], "the bench must keep working after a hostile episode"
    run = hostile["step_records"][0]["commands"][0]
    assert elapsed < 20, f"containment took {elapsed:.1f} s"
    assert not _live_processes_with(mark), "a process of the hostile command survived"
    assert host["accepted"] == [], "a connection reached the host"

    if name == "rm-rf-root":  # traversing all of /usr may take longer than the wall-clock limit
        assert run["killed"] in (None, "wall-clock timeout")
    if name in ("read-outside", "write-outside", "rm-rf-home", "network"):
        assert run["killed"] is None
    if name in ("sleeper", "fork-bomb-foreground"):
        assert run["killed"] == "wall-clock timeout" and run["seconds"] < FAST.wall_seconds + 2
    if name == "endless-loop":
        assert run["returncode"] == 152 or run["killed"] == "wall-clock timeout"  # SIGXCPU after FAST.cpu_seconds
    if name in ("output-flood", "binary-flood"):
        assert run["killed"] == "output limit" and run["seconds"] < 2
    if name == "many-files":
        assert run["killed"] == "workspace limit" and hostile["end_reason"] == "workspace_limit"
    if name == "big-file":
        assert run["returncode"] == 128 + 25  # SIGXFSZ: the file-size limit
    if name != "many-files":  # the episode went on after the hostile command
        after = hostile["step_records"][1]["commands"]
        assert after and after[0]["returncode"] == 0 and after[0]["killed"] is None
    for leftover in ("/usr/bin/dsv41-evil", "/etc/dsv41-evil", "/dsv41-evil"):
        assert not os.path.exists(leftover)
    assert not (host["dir"] / "new").exists() and not (host["dir"] / "new2").exists()


def test_hostile_outputs_do_not_reach_the_model_unbounded(jail, host):
    with jail.episode() as episode:
        read = episode.run(f"cat {host['canary']} /etc/shadow 2>&1; yes | head -c 100000000")
    assert "SECRET-CANARY" not in read.output
    assert read.killed == "output limit" and len(read.output.encode()) <= FAST.max_output_bytes
    scaffold = load_scaffold("xml")
    assert len(scaffold.observation(read.returncode, read.output, read.note())) < scaffold.max_observation_chars + 500
