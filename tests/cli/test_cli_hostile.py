"""Hostile or odd input at the CLI (issue 9, item 6).

- Odd input (bad hostlists, directories, unknown names, bad ids) is one line on stderr and a
  non-zero exit, never a traceback.
- Values other users choose (job names, drain reasons, process names in health summaries) reach
  rich only as text: on a real terminal `[/oops]`, `[red]`, `:smile:` and control sequences come
  out literally instead of crashing `bv status` or restyling an operator's screen.
- `bv logs` as root does not follow a job owner's links to files the owner cannot read.
- `bv --site FILE site validate` on a file that is not a site description quotes none of it.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import pwd
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, DevCluster

# Markup, an emoji code, a terminal title change (OSC) and a colour change (CSI).
HOSTILE_NAME = "[/oops] [red]x[/red] :smile: [link=http://e.vil]y[/link] \x1b]0;pwn\x07 end"
SHOWN_NAME = "[/oops] [red]x[/red] :smile: [link=http://e.vil]y[/link] \\x1b]0;pwn\\x07 end"
HOSTILE_REASON = "[/oops] [b]x :smile: \x1b[31mred"
SHOWN_REASON = "[/oops] [b]x :smile: \\x1b[31mred"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def _bv(*args: str, env: dict[str, str] | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bluevela", *args], capture_output=True,
                          text=True, env={**os.environ, "BV_CACHE_DIR": "off", **(env or {})},
                          cwd=cwd, timeout=120, check=False)


def _assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


SITE = str(REPO / "site.yaml")
ODD_INPUT: list[tuple[str, list[str], str]] = [
    ("bad hostlist to resume", ["health", "resume", "gpu[1-"], "not a hostlist"),
    ("bad hostlist to nightly", ["--site", SITE, "bench", "nightly", "--nodes", "x[1-"],
     "unbalanced brackets"),
    ("file that is not a site", ["--site", "/etc/shadow", "site", "validate"],
     "not a bluevela site description"),
    ("directory as site", ["site", "validate", "/etc"], "Is a directory"),
    ("nonexistent site", ["--site", "/nonexistent/site.yaml", "site", "show"],
     "No such file"),
    ("job id not a number", ["status", "abc"], "not a valid integer"),
    ("job id zero", ["logs", "0"], "Invalid value for 'JOB_ID': 0 is not in the range x>=1"),
    ("unknown command", ["nosuch"], "No such command"),
    ("unknown hook phase", ["hook", "bogus"], "bogus"),
    ("missing script", ["submit"], "Missing argument"),
    ("newline in a job name", ["submit", "--dry-run", "-J", "a\nb", "t.py"], "newline"),
    ("bad time limit", ["submit", "--dry-run", "--time", "soon", "t.py"], "not a Slurm time"),
    ("directory as NVML snapshot", ["health", "run", "--nvml-snapshot", "/etc"], "directory"),
    ("unsafe node name", ["archive", "--archive-dir", "/tmp", "node", "../etc"], "unsafe"),
    ("nonexistent archive", ["archive", "--archive-dir", "/nonexistent", "ls"],
     "does not exist"),
    ("file as archive", ["archive", "--archive-dir", "/etc/passwd", "ls"], "not a plain dir"),
    ("bad date", ["archive", "--archive-dir", "/tmp", "ls", "--since", "garbage"],
     "expected a date"),
    ("export to a missing directory",
     ["archive", "--archive-dir", "/tmp", "export", "--out", "/nonexistent/x.csv"],
     "cannot write"),
    ("bad night", ["--site", SITE, "bench", "report", "--night", "bad", "--html",
                   os.path.join(tempfile.gettempdir(), f"bv-hostile-{os.getpid()}-never-written.html")],
     "YYYY-MM-DD"),
]


@pytest.mark.parametrize(("args", "expect"), [(a, e) for _, a, e in ODD_INPUT],
                         ids=[i for i, _, _ in ODD_INPUT])
def test_odd_input_is_one_line_without_traceback(args: list[str], expect: str) -> None:
    line = _assert_one_line_error(_bv(*args))
    assert expect in line


def test_site_validate_quotes_nothing_of_a_foreign_file(tmp_path: Path) -> None:
    """A mapping-shaped file that is not a site (like /etc/shadow) is named, never echoed."""
    secret = tmp_path / "shadow"
    secret.write_text("root:$y$j9T$SECRETHASH:20228:0:99999:7:::\n"
                      "daemon:*:20228:0:99999:7:::\n")
    proc = _bv("--site", str(secret), "site", "validate")
    line = _assert_one_line_error(proc)
    assert "not a bluevela site description" in line
    assert "SECRETHASH" not in proc.stdout + proc.stderr and "daemon" not in proc.stderr


def test_site_validate_shows_only_name_like_keys(tmp_path: Path) -> None:
    """In a real site file, a key that is no name (here a shadow line) is not quoted; a typo is."""
    site = tmp_path / "site.yaml"
    site.write_text("cluster: c\nnode_classes:\n  a:\n    nodes: n1\n    gpu: {bogus: 1}\n"
                    '"root:$y$SECRETHASH:1:": 1\n')
    proc = _bv("--site", str(site), "site", "validate")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"{site}:5: node_classes.a.gpu.bogus: Unexpected keyword" in proc.stderr
    assert f"{site}:6: <key>: Unexpected keyword" in proc.stderr
    assert "SECRETHASH" not in proc.stderr


def test_site_yaml_error_does_not_quote_content(tmp_path: Path) -> None:
    site = tmp_path / "site.yaml"
    site.write_text("cluster: c\n&anchor x: *SECRETALIAS\n")
    proc = _bv("--site", str(site), "site", "validate")
    line = _assert_one_line_error(proc)
    assert "YAML syntax error" in line and "SECRETALIAS" not in line


# --- rich rendering: the shared table, the --wait live line, the nightly progress ----------

def _terminal(width: int = 240) -> tuple[io.StringIO, object]:
    from rich.console import Console

    buf = io.StringIO()
    return buf, Console(file=buf, force_terminal=True, width=width, color_system="truecolor")


def _visible(raw: str) -> str:
    return _ANSI.sub("", raw).replace("\r", "")


def test_table_shows_hostile_values_literally() -> None:
    from bluevela.cli.output import table

    buf, console = _terminal()
    table(f"Node {HOSTILE_NAME}", ["NAME", "REASON"], [(HOSTILE_NAME, HOSTILE_REASON), (1, None)],
          console=console)  # type: ignore[arg-type]
    raw = buf.getvalue()
    assert "\x1b]0;pwn" not in raw and "\x1b[31mred" not in raw
    shown = _visible(raw)
    assert shown.count(SHOWN_NAME) == 2 and SHOWN_REASON in shown, shown
    assert "\U0001f604" not in shown  # :smile: stays text


def test_table_plain_output_keeps_one_row_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bluevela.cli.output import table

    table(None, ["A", "B"], [("x\ty\nz", HOSTILE_REASON)])
    out = capsys.readouterr().out
    assert out == f"A\tB\nx\\ty\\nz\t{SHOWN_REASON}\n"


def test_wait_live_line_shows_hostile_reason_literally() -> None:
    from bluevela.cli.follow import Follower
    from bluevela.slurm.client import JobInfo
    from bluevela.slurm.states import JobState

    buf, console = _terminal()
    info = JobInfo(job_id=7, state=JobState.PENDING, state_name="PENDING", exit_code=None,
                   signal=None, nodes=("node1",), reason=HOSTILE_REASON)
    with Follower(7, live=True, console=console) as f:
        f.update(info)
    raw = buf.getvalue()
    assert "\x1b[31mred" not in raw
    assert f"job 7: PENDING on node1 ({SHOWN_REASON})" in _visible(raw)


def test_nightly_progress_shows_hostile_values_literally() -> None:
    from bluevela.bench.progress import RichEvents
    from bluevela.bench.result import Status

    buf, console = _terminal()
    with RichEvents(console=console) as events:
        events.phase("singles", 1)
        events.job("singles", HOSTILE_NAME, 9, "PENDING")
        events.done("singles", HOSTILE_NAME, Status.CRITICAL, HOSTILE_REASON)
        events.note(HOSTILE_REASON)
    raw = buf.getvalue()
    assert "\x1b]0;pwn" not in raw and "\x1b[31mred" not in raw
    shown = _visible(raw)
    assert f"CRITICAL {SHOWN_NAME}: {SHOWN_REASON}" in shown, shown


# --- on the real dev cluster, on a real terminal (pty) ------------------------------------

def _on_terminal(argv: list[str], env: dict[str, str], *, cols: int = 240,
                 timeout: float = 120) -> tuple[int, str]:
    """Run argv with stdin/stdout/stderr on a pseudo-terminal `cols` wide; its raw output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    env = {**env, "TERM": "xterm-256color", "COLUMNS": str(cols)}
    for k in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(k, None)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO,
                            close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return rc, b"".join(chunks).decode("utf-8", errors="replace")


@pytest.mark.cluster
def test_status_on_a_terminal_shows_a_hostile_job_name(devcluster: DevCluster) -> None:
    """Old: rich raised MarkupError on `[/oops]` (a traceback for everyone running bv status)."""
    job = devcluster.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", "-J",
                          HOSTILE_NAME, "--wrap", "true"]).stdout.strip()
    try:
        rc, raw = _on_terminal([sys.executable, "-m", "bluevela", "status", job],
                               devcluster.environ())
    finally:
        devcluster.run(["scancel", job], check=False)
    shown = _visible(raw)
    assert rc == 0 and "Traceback" not in shown, shown
    assert "\x1b]0;pwn" not in raw
    assert SHOWN_NAME in shown and "JobHeldUser" in shown, shown


@pytest.mark.cluster
def test_health_nodes_on_a_terminal_shows_a_hostile_reason(devcluster: DevCluster) -> None:
    node = devcluster.nodes[-1]
    devcluster.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN",
                    f"Reason={HOSTILE_REASON}"])
    try:
        rc, raw = _on_terminal([sys.executable, "-m", "bluevela", "health", "nodes"],
                               devcluster.environ())
    finally:
        devcluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
    shown = _visible(raw)
    assert rc == 0 and "Traceback" not in shown, shown
    assert "\x1b[31mred" not in raw
    assert SHOWN_REASON in shown, shown


# --- bv logs: odd output paths, and the owner's links as root ------------------------------

@pytest.fixture
def owner_dir() -> Iterator[tuple[Path, str]]:
    """A directory owned by an unprivileged user (nobody), outside root's private tmp."""
    user = "nobody"
    pw = pwd.getpwnam(user)
    d = Path(tempfile.mkdtemp(prefix="bv-logs-"))
    d.chmod(0o755)
    (d / "u").mkdir()
    os.chown(d / "u", pw.pw_uid, pw.pw_gid)
    yield d, user
    shutil.rmtree(d, ignore_errors=True)


def _held_job(cluster: DevCluster, user: str, output: Path, cwd: Path) -> str:
    """A held job submitted by `user` whose output path is `output` (it never runs)."""
    argv = ["sbatch", "--parsable", "--hold", "-o", str(output), "--wrap", "true"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=cluster.environ(),
                          cwd=cwd, user=user, timeout=60, check=True)
    return proc.stdout.strip().split(";")[0]


@pytest.mark.cluster
@pytest.mark.parametrize("link", ["symlink", "parent-symlink", "hardlink"])
def test_logs_as_root_does_not_follow_the_owners_links(
        devcluster: DevCluster, owner_dir: tuple[Path, str], link: str) -> None:
    """Old: `bv logs` as root printed the root-only file the job owner linked to."""
    d, user = owner_dir
    secret_dir = d / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "shadow"
    secret.write_text("SECRET-ROOT-ONLY\n")
    secret.chmod(0o600)
    home = d / "u"
    if link == "symlink":
        out = home / "out.log"
        out.symlink_to(secret)
    elif link == "parent-symlink":
        (home / "dir").symlink_to(secret_dir)
        out = home / "dir" / "shadow"
    else:  # what fs.protected_hardlinks=0 would let the owner make
        out = home / "out.log"
        os.link(secret, out)
    job = _held_job(devcluster, user, out, home)
    try:
        proc = devcluster.bv("logs", job, check=False)
    finally:
        devcluster.run(["scancel", job], check=False)
    assert "SECRET" not in proc.stdout + proc.stderr
    _assert_one_line_error(proc)


@pytest.mark.cluster
def test_logs_as_root_prints_the_owners_own_file(devcluster: DevCluster,
                                                 owner_dir: tuple[Path, str]) -> None:
    d, user = owner_dir
    pw = pwd.getpwnam(user)
    out = d / "u" / "out.log"
    out.write_text("hello from the job\n")
    os.chown(out, pw.pw_uid, pw.pw_gid)
    out.chmod(0o600)
    job = _held_job(devcluster, user, out, d / "u")
    try:
        proc = devcluster.bv("logs", job, check=False)
    finally:
        devcluster.run(["scancel", job], check=False)
    assert proc.returncode == 0 and proc.stdout == "hello from the job\n", proc


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_logs_of_an_output_path_that_is_no_file(devcluster: DevCluster, tmp_path: Path,
                                                kind: str) -> None:
    """Old: a directory gave a traceback (IsADirectoryError); a FIFO hung bv logs."""
    out = tmp_path / "out"
    if kind == "directory":
        out.mkdir()
    else:
        os.mkfifo(out)
    job = devcluster.run(["sbatch", "--parsable", "--hold", "-o", str(out), "--wrap", "true"],
                         cwd=tmp_path).stdout.strip()
    try:
        proc = devcluster.bv("logs", job, check=False, timeout=30)
    finally:
        devcluster.run(["scancel", job], check=False)
    assert "not a job's output file" in _assert_one_line_error(proc)


def test_archive_views_on_a_terminal_show_hostile_values(tmp_path: Path) -> None:
    """Archived user/partition strings come from Slurm's job record: shown literally on a tty."""
    from bluevela.archive.ingest import ingest
    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import write_report

    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    for phase in ("prolog", "epilog"):
        write_report(spool, sample_report(5, "n1", phase, user="[/oops]",
                                          partition="[red]p\x1b[31m"))
    ingest(spool, archive, now=1.7e9 + 10)
    env = {**os.environ, "BV_ARCHIVE_DIR": str(archive), "BV_SPOOL_DIR": str(spool)}
    for args in (["archive", "ls"], ["archive", "show", "5"], ["archive", "node", "n1"]):
        rc, raw = _on_terminal([sys.executable, "-m", "bluevela", *args], env)
        shown = _visible(raw)
        assert rc == 0 and "Traceback" not in shown, (args, shown)
        assert "\x1b[31m" not in raw, (args, raw)
        if args[1] != "node":
            assert "[/oops]" in shown and "[red]p\\x1b[31m" in shown, (args, shown)
