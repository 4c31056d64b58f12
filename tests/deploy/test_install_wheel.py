"""The package, not a checkout (issue 24 §4): the wheel carries the shims, units, Prometheus
files, hooks.conf and logrotate file as package data, and the `bv` of a venv it is installed
in lays out a node with `bv install --root`: the right tree, idempotent, switched between
versions by one rename of `current`, removed exactly by `--uninstall`.

Everything runs for real: `pip wheel` on a copy of the source tree, `python -m venv`, `pip
install` of the built wheel, the venv's own `bv` entry point, `systemd-analyze verify` on the
laid-out units. The venv sees the system's site-packages (click, pydantic, torch ...) through
a .pth line, never the editable install of this checkout: `bluevela` resolves to the wheel.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import shutil
import site
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bluevela import __version__
from bluevela.deploy.fleet_account import Account, fleet_account, remove_fleet_account
from bluevela.deploy.layout import InstallError, Result

REPO = Path(__file__).resolve().parents[2]
_CACHES = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".*")
TOP_SKIP = {"tests", "benchmarks", "examples", "docs"}


def _ignore(directory: str, names: list[str]) -> set[str]:
    """No VCS, caches or build output anywhere; no tests/docs at the top (the wheel has none)."""
    skip = set(_CACHES(directory, names))
    if Path(directory) == REPO:
        skip |= TOP_SKIP & set(names)
    return skip
SHIMS = ("prolog", "epilog", "healthcheck", "epilog_slurmctld", "sampler")


def sources() -> dict[str, bytes]:
    """What the wheel must carry, from the top-level source of truth."""
    out: dict[str, bytes] = {}
    for path in sorted((REPO / "prolog_epilog").rglob("*")):
        rel = path.relative_to(REPO)
        if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
            out[rel.as_posix()] = path.read_bytes()
    out["slurm/hooks.conf"] = (REPO / "slurm" / "hooks.conf").read_bytes()
    return out


def build_wheel(out: Path) -> Path:
    """`pip wheel` on a copy of the source tree (no build/ left in the checkout)."""
    src = out / "src"
    shutil.copytree(REPO, src, ignore=_ignore, symlinks=True)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    (wheel,) = (out / "dist").glob("bluevela-*.whl")
    return wheel


def make_venv(where: Path, wheel: Path) -> Path:
    """A venv with the wheel installed; the system site-packages reachable for the
    dependencies only (a .pth line: the checkout's editable-install hook is not run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=120)
    purelib = subprocess.run([str(where / "bin" / "python3"), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "bv-test-deps.pth").write_text(
        "".join(f"{d}\n" for d in site.getsitepackages() if Path(d).is_dir()))
    # pip --python: this interpreter's pip installs into the venv, entry points included
    # (their #! names the venv's python), without ensurepip in every venv.
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(where / "bin" / "python3"),
                        "install", "-q", "--no-deps", "--no-compile", str(wheel)],
                       capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert p.returncode == 0, p.stderr
    return where


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The built wheel and one venv with it installed."""
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    return wheel, make_venv(base / "venv-a", wheel)


def bv(venv: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "BV_"))}
    p = subprocess.run([str(venv / "bin" / "bv"), *args], capture_output=True, text=True,
                       timeout=120, check=False, cwd="/", env=env)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def tree(root: Path) -> dict[str, str]:
    """Every path under root: file -> mode + sha256, symlink -> target, dir -> 'dir'."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = "/" + path.relative_to(root).as_posix()
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            out[rel] = "-> " + os.readlink(path)
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = f"dir {stat.S_IMODE(st.st_mode):04o}"
        else:
            out[rel] = (f"{stat.S_IMODE(st.st_mode):04o} "
                        f"{hashlib.sha256(path.read_bytes()).hexdigest()}")
    return out


def test_wheel_carries_the_sources_byte_for_byte(built: tuple[Path, Path]) -> None:
    wheel, venv = built
    want = sources()
    with zipfile.ZipFile(wheel) as zf:
        got = {n.removeprefix("bluevela/_data/"): zf.read(n) for n in zf.namelist()
               if n.startswith("bluevela/_data/") and not n.endswith("/")}
        modes = {n.removeprefix("bluevela/_data/"): (zf.getinfo(n).external_attr >> 16) & 0o777
                 for n in zf.namelist() if n.startswith("bluevela/_data/")}
    assert set(got) == set(want)
    assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]]
    assert all(modes[f"prolog_epilog/{s}"] & 0o111 for s in SHIMS)
    # Units of other helpers (fleet metrics) are picked up as they appear in prolog_epilog/.
    assert {"prolog_epilog/bv-sampler.service", "prolog_epilog/bv-ingest.timer",
            "prolog_epilog/bv-nightly.timer"} <= set(got)
    # Only the wheel's copy is importable from the venv, and it reads its own package data.
    p = subprocess.run([str(venv / "bin" / "python3"), "-I", "-c",
                        "import bluevela, bluevela.deploy.data as d; "
                        "print(bluevela.__file__); print(d.root())"],
                       capture_output=True, text=True, check=True, cwd="/")
    pkg, data_root = p.stdout.split()
    assert pkg.startswith(str(venv)) and data_root.startswith(str(venv)), p.stdout
    assert data_root.endswith("bluevela/_data")


def test_install_lays_out_the_node_idempotently_and_uninstalls_clean(
        built: tuple[Path, Path], tmp_path: Path) -> None:
    _, venv = built
    root = tmp_path / "root"
    root.mkdir()
    dry = bv(venv, "install", "--root", str(root), "--dry-run")
    assert "dry run, nothing written" in dry.stdout
    assert not any(root.iterdir()), "a dry run wrote something"

    first = bv(venv, "install", "--root", str(root))
    assert "bv install: done" in first.stdout
    # The fleet unit's user and directory are the host's, not a staged tree's: only listed.
    assert ("under --root, user bvfleet and its textfile directory are not made: on the host "
            "that runs bv-fleet-metrics run useradd --system --user-group --no-create-home "
            "--home-dir /nonexistent --shell /usr/sbin/nologin bvfleet; install -d -o root -g "
            "bvfleet -m 1775 /var/lib/node_exporter/textfile") in first.stdout.splitlines()
    assert not (root / "var").exists()
    t = tree(root)
    src = sources()
    for s in SHIMS:
        f = root / "opt/bluevela/prolog_epilog" / s
        assert f.read_bytes() == src[f"prolog_epilog/{s}"]
        assert stat.S_IMODE(f.stat().st_mode) == 0o755
    assert (root / "opt/bluevela/slurm/hooks.conf").read_bytes() == src["slurm/hooks.conf"]
    assert (root / "opt/bluevela/prolog_epilog/prometheus/tests/bluevela.rules.test.yml"
            ).read_bytes() == src["prolog_epilog/prometheus/tests/bluevela.rules.test.yml"]
    for name in [k.split("/")[-1] for k in src if k.endswith((".service", ".timer"))]:
        assert (root / "etc/systemd/system" / name).read_bytes() == src[f"prolog_epilog/{name}"]
    assert (root / "etc/logrotate.d/bluevela").read_bytes() == src[
        "prolog_epilog/bluevela.logrotate"]
    assert (root / "etc/bluevela/python").read_text() == "/opt/bluevela/current/bin/python3\n"
    assert os.readlink(root / "opt/bluevela/current") == str(venv)
    # Through the switch: the interpreter and the package the shims will run.
    p = subprocess.run([str(root / "opt/bluevela/current/bin/python3"), "-I", "-c",
                        "import bluevela; print(bluevela.__file__)"],
                       capture_output=True, text=True, check=True, cwd="/")
    assert "/opt/bluevela/current/lib/" in p.stdout
    # No file group/other-writable (the hooks run them as root).
    assert not [p for p in root.rglob("*") if not p.is_symlink() and p.stat().st_mode & 0o022]
    manifest = json.loads((root / "opt/bluevela/install-manifest.json").read_text())
    assert {e["path"] for e in manifest["items"]} == {
        k for k, v in t.items() if not v.startswith("dir")} - {"/opt/bluevela/install-manifest.json"}

    second = bv(venv, "install", "--root", str(root))
    assert second.stdout.strip() == f"bv install: nothing to change ({__version__}, root {root})"
    assert tree(root) == t

    # An edited shim is put back (the package is the source of truth); nothing else moves.
    shim = root / "opt/bluevela/prolog_epilog/prolog"
    shim.write_text("#!/bin/sh\nexit 1\n")
    third = bv(venv, "install", "--root", str(root))
    assert third.stdout.splitlines()[0].split() == ["update", "/opt/bluevela/prolog_epilog/prolog",
                                                    "(0755)"]
    assert tree(root) == t

    # The units are valid systemd units whose ExecStart is what bv install laid out.
    if shutil.which("systemd-analyze"):
        for unit in (root / "etc/systemd/system").iterdir():
            text = unit.read_text().replace("/opt/bluevela/", f"{root}/opt/bluevela/")
            copy = tmp_path / "units" / unit.name
            copy.parent.mkdir(exist_ok=True)
            copy.write_text(text.replace("User=bvnightly", "User=root"))
        for suffix in ("service", "timer"):
            units = sorted(str(u) for u in (tmp_path / "units").glob(f"*.{suffix}"))
            v = subprocess.run(["systemd-analyze", "verify", "--man=no", *units],
                               capture_output=True, text=True, timeout=60, check=False)
            assert v.returncode == 0 and "bluevela" not in v.stderr, v.stderr

    # Uninstall: everything it laid out, the directories it made, nothing else.
    keep = root / "etc/bluevela/site.yaml"
    keep.write_text("cluster: x\n")
    before = tree(root)
    dry_un = bv(venv, "install", "--root", str(root), "--uninstall", "--dry-run")
    assert "remove  /opt/bluevela/prolog_epilog/prolog" in dry_un.stdout
    assert "remove  /opt/bluevela/" in dry_un.stdout.splitlines()  # it would be empty then
    assert "dry run, nothing written" in dry_un.stdout and tree(root) == before
    un = bv(venv, "install", "--root", str(root), "--uninstall")
    assert "kept /etc/bluevela/: not empty" in un.stdout
    assert tree(root) == {"/etc": "dir 0755", "/etc/bluevela": "dir 0755",
                          "/etc/bluevela/site.yaml": tree(root)["/etc/bluevela/site.yaml"]}
    keep.unlink()
    again = bv(venv, "install", "--root", str(root), "--uninstall")
    assert "nothing was installed here" in again.stdout


def test_versions_switch_by_rename_and_roll_back(built: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    """Two versions side by side under /opt/bluevela/<version>: each one's bv install points
    `current` at itself (a relative name, one rename), and the other's switches back."""
    wheel, _ = built
    root = tmp_path / "root"
    (root / "opt/bluevela").mkdir(parents=True, mode=0o755)
    (root / "opt").chmod(0o755)
    old = make_venv(root / "opt/bluevela/0.0.9", wheel)
    new = make_venv(root / "opt/bluevela/0.1.0", wheel)
    bv(old, "install", "--root", str(root))
    link = root / "opt/bluevela/current"
    assert os.readlink(link) == "0.0.9"
    out = bv(new, "install", "--root", str(root)).stdout
    assert os.readlink(link) == "0.1.0"
    # Only the switch changed: the same package data laid out by both.
    assert out.splitlines()[:-1] == ["update  /opt/bluevela/current  (-> 0.1.0)"]
    assert not list(link.parent.glob(".current.bv-install-*"))  # no temporary name left
    bv(old, "install", "--root", str(root))
    assert os.readlink(link) == "0.0.9"
    manifest = json.loads((root / "opt/bluevela/install-manifest.json").read_text())
    assert manifest["venv"] == str(old)


def test_a_file_the_new_version_no_longer_ships_is_removed(built: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    _, venv = built
    root = tmp_path / "root"
    root.mkdir()
    bv(venv, "install", "--root", str(root))
    mpath = root / "opt/bluevela/install-manifest.json"
    manifest = json.loads(mpath.read_text())
    gone = root / "etc/systemd/system/bv-old.timer"
    gone.write_text("[Timer]\n")
    digest = hashlib.sha256(b"[Timer]\n").hexdigest()
    manifest["items"].append({"path": "/etc/systemd/system/bv-old.timer", "mode": "0644",
                              "sha256": digest})
    # A manifest entry outside the layout's places is never acted on.
    victim = tmp_path / "victim"
    victim.write_text("x")
    manifest["items"].append({"path": "/../victim", "mode": "0644",
                              "sha256": hashlib.sha256(b"x").hexdigest()})
    manifest["items"].append({"path": "/opt/bluevela/../../victim", "mode": "0644",
                              "sha256": hashlib.sha256(b"x").hexdigest()})
    mpath.write_text(json.dumps(manifest))
    out = bv(venv, "install", "--root", str(root)).stdout
    assert "remove  /etc/systemd/system/bv-old.timer" in out
    assert not gone.exists() and victim.exists()


def test_refusals_are_one_line(built: tuple[Path, Path], tmp_path: Path) -> None:
    _, venv = built
    root = tmp_path / "root"
    (root / "opt/bluevela").mkdir(parents=True)
    (root / "opt/bluevela").chmod(0o777)
    p = bv(venv, "install", "--root", str(root), check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "group/other-writable" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (root / "opt/bluevela/current").exists()
    (root / "opt/bluevela").chmod(0o755)
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "etc").write_text("a file where a directory belongs")
    p = bv(venv, "install", "--root", str(blocked), check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("bv: error: ") and len(p.stderr.strip().splitlines()) == 1
    p = bv(venv, "install", "--root", "relative/dir", check=False)
    assert p.returncode != 0 and "not an existing absolute directory" in p.stderr
    # Uninstall while slurm.conf still runs the shims: Slurm would drain every node.
    bv(venv, "install", "--root", str(root))
    (root / "etc/slurm").mkdir(parents=True)
    (root / "etc/slurm/slurm.conf").write_text("Prolog=/opt/bluevela/prolog_epilog/prolog\n")
    p = bv(venv, "install", "--root", str(root), "--uninstall", check=False)
    assert p.returncode != 0 and "slurm.conf still runs the hooks" in p.stderr
    assert (root / "opt/bluevela/prolog_epilog/prolog").exists()
    # Not from a venv: refused (python -m bluevela with the system interpreter).
    p = subprocess.run([sys.executable, "-m", "bluevela", "install", "--root", str(root),
                        "--dry-run"], capture_output=True, text=True, check=False, cwd=REPO)
    if sys.prefix == sys.base_prefix:
        assert p.returncode != 0 and "is not in a venv" in p.stderr, p.stderr


def test_requires_python_is_the_oldest_tested() -> None:
    """pyproject claims >=3.11; this suite's interpreter is the one the wheel tests install
    into, and it must be the oldest claimed or newer."""
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert meta["requires-python"] == ">=3.11"
    assert sys.version_info >= (3, 11)


# -- the fleet unit's account (bv install at /) --------------------------------------------------

TEST_USER = "bvtest-h12"  # a user of the test's own, never the real bvfleet
SYS_PYTHON = "/usr/bin/python3"  # one the test's user may run (pyenv's is under /root)


def _user(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


@pytest.fixture
def account() -> Iterator[Account]:
    if os.geteuid() != 0 or not shutil.which("useradd") or not os.path.exists(SYS_PYTHON):
        pytest.skip("needs root, useradd and /usr/bin/python3")
    assert _user(TEST_USER) is None, f"{TEST_USER} left over from an earlier run"
    # Not under pytest's 0700 tmp dirs: the test's user must reach the directory.
    base = tempfile.mkdtemp(prefix="bv-fleet-account-")
    os.chmod(base, 0o755)
    try:
        yield Account(TEST_USER, os.path.join(base, "node_exporter", "textfile"))
    finally:
        shutil.rmtree(base)
        if _user(TEST_USER) is not None:  # a failed test's leftover
            subprocess.run(["userdel", TEST_USER], check=False)


def _as_user(user: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", SYS_PYTHON, "-I", "-c", code],
                          capture_output=True, text=True, timeout=30, check=False, cwd="/")


def test_fleet_account_created_idempotent_and_removed(account: Account) -> None:
    """What bv-fleet-metrics.service needs on its host, for real: a system user with no home
    and no login shell, its textfile directory root:<user> 1775 where the user writes its own
    file but cannot replace root's; a second run changes nothing; the uninstall removes the
    directory and the user bv created. Before, bv install made neither (the unit's docs listed
    the commands to type)."""
    dry = Result("/", "x", True)
    assert fleet_account(Path("/"), None, dry, dry_run=True, account=account) is not None
    assert [(c.action, c.path) for c in dry.changes] == [
        ("create", f"user {TEST_USER}"), ("create", account.textfile)]
    assert _user(TEST_USER) is None and not os.path.exists(account.textfile)

    first = Result("/", "x", False)
    record = fleet_account(Path("/"), None, first, dry_run=False, account=account)
    assert record == {"user_created": True, "textfile_created": True}
    assert [c.line() for c in first.changes] == [
        f"create  user {TEST_USER}  (system, no home, nologin)",
        f"create  {account.textfile}  (root:{TEST_USER} 1775)"]
    pw = _user(TEST_USER)
    assert pw is not None and pw.pw_shell == "/usr/sbin/nologin" and pw.pw_uid < 1000
    assert pw.pw_dir == "/nonexistent" and not os.path.exists("/nonexistent")
    st = os.lstat(account.textfile)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (
        0, grp.getgrnam(TEST_USER).gr_gid, 0o1775)

    # The unit's layout at work: root's file (the hooks' bluevela.prom) stays root's.
    hooks = Path(account.textfile) / "bluevela.prom"
    hooks.write_text("bluevela_node_status 0\n")
    hooks.chmod(0o644)
    own = Path(account.textfile) / "bluevela_fleet.prom"
    p = _as_user(TEST_USER, f"open({str(own) + '.tmp'!r}, 'w').write('x 1\\n'); "
                 f"import os; os.rename({str(own) + '.tmp'!r}, {str(own)!r})")
    assert p.returncode == 0, p.stderr
    p = _as_user(TEST_USER, f"import os; open({str(own) + '.x'!r}, 'w'); "
                 f"os.rename({str(own) + '.x'!r}, {str(hooks)!r})")
    assert p.returncode != 0 and "PermissionError" in p.stderr, p.stderr
    assert hooks.read_text() == "bluevela_node_status 0\n"

    second = Result("/", "x", False)
    assert fleet_account(Path("/"), record, second, dry_run=False, account=account) == record
    assert second.changes == [] and second.notes == []

    # Uninstall: a directory with files is kept (its group is going away: root's again).
    un = Result("/", "x", False)
    remove_fleet_account(Path("/"), record, un, dry_run=False, account=account)
    assert [c.line() for c in un.changes] == [f"remove  user {TEST_USER}"]
    assert un.notes == [f"kept {account.textfile}/: not empty"]
    st = os.lstat(account.textfile)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0o755) and _user(TEST_USER) is None


def test_fleet_account_leaves_what_bv_did_not_create(account: Account) -> None:
    """A user the site made itself is kept at uninstall; a directory that was there (root's,
    0755) is set to root:<user> 1775 and gets its old group and mode back; an empty directory
    bv created is removed; a symlink in its place is refused, never followed."""
    subprocess.run(account.useradd(), check=True)  # the site's own user
    os.makedirs(account.textfile, 0o755)
    os.chmod(account.textfile, 0o755)
    r = Result("/", "x", False)
    record = fleet_account(Path("/"), None, r, dry_run=False, account=account)
    assert record == {"user_created": False, "textfile_created": False,
                      "textfile_was": {"gid": 0, "mode": "0755"}}
    assert [c.line() for c in r.changes] == [
        f"update  {account.textfile}  (root:{TEST_USER} 1775 (was gid 0, 0755))"]
    # Through the manifest's JSON, as the uninstall reads it.
    record = json.loads(json.dumps(record))
    un = Result("/", "x", False)
    remove_fleet_account(Path("/"), record, un, dry_run=False, account=account)
    assert [c.line() for c in un.changes] == [f"update  {account.textfile}  (back to gid 0, 0755)"]
    assert un.notes == [f"kept user {TEST_USER}: bv install did not create it"]
    st = os.lstat(account.textfile)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0o755) and _user(TEST_USER) is not None

    os.rmdir(account.textfile)
    created = fleet_account(Path("/"), None, Result("/", "x", False), dry_run=False,
                            account=account)
    un = Result("/", "x", False)
    remove_fleet_account(Path("/"), created, un, dry_run=False, account=account)
    assert [c.line() for c in un.changes] == [f"remove  {account.textfile}"]
    assert not os.path.exists(account.textfile)

    target = Path(account.textfile).parent / "elsewhere"
    target.mkdir()
    os.symlink(target, account.textfile)
    with pytest.raises(InstallError, match="is not a directory .a symlink is never followed"):
        fleet_account(Path("/"), None, Result("/", "x", False), dry_run=False, account=account)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


# --------------------------------------------------------------------------------------------
# What `current` will name runs as root (issue 33 §3): the venv, and where bluevela comes from

def _refused(p: subprocess.CompletedProcess[str], why: str) -> None:
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert p.stderr.startswith("bv: error: ") and len(p.stderr.strip().splitlines()) == 1
    assert why in p.stderr and "refused (--force" in p.stderr, p.stderr


def test_a_venv_others_can_change_is_refused_and_force_warns(
        built: tuple[Path, Path], tmp_path: Path) -> None:
    """Before, bv install pointed `current` (what every root hook runs, `python3 -I`, which
    still reads .pth files) at a 0777 venv owned by nobody without a word. Now each way to
    change what root runs is refused with one line, nothing laid out; --force installs and
    says it on stderr."""
    wheel, _ = built
    venv = make_venv(tmp_path / "venv", wheel)
    root = tmp_path / "root"
    root.mkdir()
    sp = next((venv / "lib").glob("python3*/site-packages"))
    for path, mode, why in [
            (venv, 0o777, f"the venv {venv} is group/other-writable (mode 0777)"),
            (venv / "bin", 0o775, "the venv's bin/"),
            (sp, 0o757, f"the venv's site-packages {sp} is group/other-writable"),
            (tmp_path, 0o777, f"the directory above the venv {tmp_path} is group/other")]:
        old = stat.S_IMODE(path.stat().st_mode)
        path.chmod(mode)
        try:
            _refused(bv(venv, "install", "--root", str(root), check=False), why)
        finally:
            path.chmod(old)
        assert not (root / "opt").exists()
    # A .pth file the hooks' Python reads, naming a directory anyone may write.
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    (sp / "zz-planted.pth").write_text(f"{planted}\n")
    _refused(bv(venv, "install", "--root", str(root), check=False),
             f"a directory zz-planted.pth adds {planted} is group/other-writable")
    (sp / "zz-planted.pth").unlink()
    # Owned by another user (a deploy user, an NFS export): refused, and with --force done.
    nobody = pwd.getpwnam("nobody").pw_uid
    for path in [venv, *venv.rglob("*")]:
        os.lchown(path, nobody, -1)
    _refused(bv(venv, "install", "--root", str(root), check=False),
             f"the venv {venv} is owned by uid {nobody}, not root")
    forced = bv(venv, "install", "--root", str(root), "--force")
    assert "bv install: WARNING: --force: the venv" in forced.stderr, forced.stderr
    assert f"owned by uid {nobody}" in forced.stderr
    assert os.readlink(root / "opt/bluevela/current") == str(venv)
    js = json.loads(bv(venv, "install", "--root", str(root), "--force", "--json").stdout)
    assert any(f"owned by uid {nobody}" in w for w in js["warnings"])


def test_an_editable_install_is_refused(built: tuple[Path, Path], tmp_path: Path) -> None:
    """bluevela installed with `pip install -e` from a source tree: root's hooks would import
    whatever that tree holds (a developer's checkout). Refused; --force (a dev machine)
    warns. This machine's own bluevela is such an install (from the repo)."""
    wheel, _ = built
    src = wheel.parent.parent / "src"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    purelib = next((venv / "lib").glob("python3*/site-packages"))
    (purelib / "bv-test-deps.pth").write_text(
        "".join(f"{d}\n" for d in site.getsitepackages() if Path(d).is_dir()))
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python3"),
                        "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(src)],
                       capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert p.returncode == 0, p.stderr
    root = tmp_path / "root"
    root.mkdir()
    p = bv(venv, "install", "--root", str(root), check=False)
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "editable install" in p.stderr or "runs from a checkout" in p.stderr, p.stderr
    assert not (root / "opt").exists()
    forced = bv(venv, "install", "--root", str(root), "--force")
    assert "bv install: WARNING: --force: bluevela" in forced.stderr, forced.stderr
