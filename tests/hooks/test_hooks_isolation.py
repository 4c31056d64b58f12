"""Root entry points run isolated from their working directory and from PYTHON* variables, read
the site only from what root configured, say loudly when pointed at fixtures, and never run two
hook runs on a node at once.

slurmd starts Prolog/Epilog/HealthCheckProgram in its own working directory (its log dir);
before the fix the shims ran `python -m bluevela.hooks`, so a `logging.py` planted there ran as
root and a `./site.yaml` there replaced /etc/bluevela/site.yaml.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bluevela.errors import SiteConfigError
from bluevela.hooks.env import fixture_warning
from bluevela.site_file import ETC_SITE, find_site_path
from tests.conftest import DevCluster
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()
SHIMS = REPO / "prolog_epilog"
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"

needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a private mount namespace for /etc/bluevela needs root and unshare")

# A planted site: the quick/full tiers only run `node`, and the paths lead elsewhere.
PLANTED_SITE = """cluster: planted
paths: {{spool: {d}/spool, archive: {d}/archive, state: {d}/state, metrics: {d}/metrics}}
health:
  tiers:
    quick: {{checks: [node], cap_s: 5, check_timeout_s: 3}}
    full: {{checks: [node], cap_s: 5, check_timeout_s: 3}}
node_classes:
  h100: {{nodes: "gpu[001-999]", gpus: 0}}
"""


def _canary_module(canary: Path) -> str:
    return f"open({str(canary)!r}, 'w').write('ran as uid %d' % __import__('os').getuid())\n"


def plant(tmp_path: Path) -> tuple[Path, dict[str, str], dict[str, Path]]:
    """A hostile working directory and hostile PYTHON* variables; returns (cwd, env, canaries).

    Each vector writes its own canary file when Python honours it.
    """
    canaries = {k: tmp_path / f"pwned-{k}" for k in
                ("cwd", "pythonpath", "usersite-env", "usersite-home", "startup")}
    cwd = tmp_path / "slurmd-logdir"
    cwd.mkdir()
    decoy = tmp_path / "decoy"
    for d in ("spool", "archive", "state", "metrics"):
        (decoy / d).mkdir(parents=True)
    for mod in ("logging", "hostlist", "yaml", "json"):
        (cwd / f"{mod}.py").write_text(_canary_module(canaries["cwd"]))
    (cwd / "site.yaml").write_text(PLANTED_SITE.format(d=decoy))
    pypath = tmp_path / "pythonpath"
    pypath.mkdir()
    (pypath / "logging.py").write_text(_canary_module(canaries["pythonpath"]))
    pth = f"import os; open({str(canaries['usersite-env'])!r}, 'w').write('x')\n"
    usersite = tmp_path / "userbase" / "lib" / PYVER / "site-packages"
    usersite.mkdir(parents=True)
    (usersite / "evil.pth").write_text(pth)
    homesite = tmp_path / "home" / ".local" / "lib" / PYVER / "site-packages"
    homesite.mkdir(parents=True)
    (homesite / "evil.pth").write_text(pth.replace("usersite-env", "usersite-home"))
    startup = tmp_path / "startup.py"
    startup.write_text(_canary_module(canaries["startup"]))
    env = {"PYTHONPATH": str(pypath), "PYTHONUSERBASE": str(tmp_path / "userbase"),
           "HOME": str(tmp_path / "home"), "PYTHONSTARTUP": str(startup)}
    return cwd, env, canaries


def etc_bluevela(tmp_path: Path, hook_env: dict[str, str], site_paths: Path) -> Path:
    """What root configured: /etc/bluevela/{python,hook.env,site.yaml} (no BV_SITE: the site
    is /etc/bluevela/site.yaml), bind-mounted in a private mount namespace by `run_shim`."""
    etc = tmp_path / "etc-bluevela"
    etc.mkdir()
    (etc / "python").write_text(sys.executable + "\n")
    (etc / "hook.env").write_text("".join(f"{k}={v}\n" for k, v in hook_env.items()))
    (etc / "hook.env").chmod(0o644)
    site = (REPO / "site.yaml").read_text()
    for which in ("spool", "archive", "state", "metrics"):
        (site_paths / which).mkdir(parents=True, exist_ok=True)
        site = site.replace(f"  {which}: /", f"  {which}: {site_paths / which}  # /", 1)
    (etc / "site.yaml").write_text(site)
    return etc


def run_shim(shim: Path, etc: Path, cwd: Path, env: dict[str, str]
             ) -> subprocess.CompletedProcess[str]:
    """The shim as slurmd runs it: root, no PATH, started in `cwd`, /etc/bluevela = `etc`."""
    Path("/etc/bluevela").mkdir(exist_ok=True)
    assigns = [f"{k}={v}" for k, v in env.items()]
    script = ('mount --bind "$1" /etc/bluevela && cd "$2" && shift 2 && '
              'exec /usr/bin/env -i "$@"')
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                           script, "sh", str(etc), str(cwd), *assigns, "/bin/sh", str(shim)],
                          capture_output=True, text=True, timeout=180, check=False)


def fixture_hook_env(state: Path, **extra: str) -> dict[str, str]:
    bogus = state.parent / "bogus-slurm.conf"
    bogus.write_text("NotAnOption\n")  # Slurm unreachable: nothing is really drained
    return {"BV_NODE_CLASS": "h100", "BV_CACHE_DIR": "off",
            "BV_SYSFS_ROOT": str(FIXTURES / "h100-healthy" / "root"),
            "BV_NVML_SNAPSHOT": str(FIXTURES / "h100-healthy" / "nvml.json"),
            "SLURM_CONF": str(bogus), **extra}


@needs_unshare
@pytest.mark.parametrize("phase", ["prolog", "epilog", "healthcheck"])
def test_shim_ignores_code_and_site_planted_in_its_working_directory(
        phase: str, tmp_path: Path) -> None:
    cwd, py_env, canaries = plant(tmp_path)
    real = tmp_path / "real"
    etc = etc_bluevela(tmp_path, fixture_hook_env(real), real)
    slurm = {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_NODELIST": "gpu001"}
    if phase == "healthcheck":
        del slurm["SLURM_JOB_ID"]
    p = run_shim(SHIMS / phase, etc, cwd, {**slurm, **py_env})
    assert p.returncode == 0, p.stderr
    ran = {k: c.read_text() for k, c in canaries.items() if c.exists()}
    assert not ran, f"planted code ran as root via {sorted(ran)}: {ran}\n{p.stderr}"
    assert "hook error" not in p.stderr, p.stderr
    # The site read is /etc/bluevela/site.yaml (its tiers, its paths), not ./site.yaml.
    last = json.loads((real / "state" / "last_run.json").read_text())
    names = [c["name"] for c in last["health"]["checks"]]
    assert names[:3] == ["gpu", "ib", "node"], names
    assert not any(any((tmp_path / "decoy" / d).iterdir()) for d in ("spool", "state", "metrics"))
    if phase != "healthcheck":
        assert (real / "spool" / f"77.gpu001.{phase}.json").is_file()
    # A hook.env pointing production hooks at fixtures says so in the run's log.
    assert "WARNING: FIXTURES IN USE: BV_SYSFS_ROOT=" in p.stderr, p.stderr


@needs_unshare
def test_epilog_slurmctld_shim_ignores_its_working_directory(tmp_path: Path) -> None:
    """EpilogSlurmctld: planted code does not run; the spool comes from the real site, not a
    decoy site in the working directory (whose spool holds a planted job)."""
    from bluevela.archive import query
    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import write_report

    cwd, py_env, canaries = plant(tmp_path)
    real = tmp_path / "real"
    etc = etc_bluevela(tmp_path, {"BV_ARCHIVE_WAIT_S": "0", "BV_CACHE_DIR": "off"}, real)
    now = time.time()
    for phase in ("prolog", "epilog"):
        write_report(real / "spool", sample_report(51, "n1", phase, nodelist=["n1"], time=now))
        write_report(tmp_path / "decoy" / "spool",
                     sample_report(51, "evil", phase, nodelist=["evil"], time=now))
    p = run_shim(SHIMS / "epilog_slurmctld", etc, cwd, {"SLURM_JOB_ID": "51", **py_env})
    assert p.returncode == 0, p.stderr
    ran = {k: c.read_text() for k, c in canaries.items() if c.exists()}
    assert not ran, f"planted code ran via {sorted(ran)}: {ran}\n{p.stderr}"
    job = query.show_job(real / "archive", 51)
    assert [n["node"] for n in job["nodes"]] == ["n1"]
    assert len(list((tmp_path / "decoy" / "spool").glob("51.*.json"))) == 2


def test_python_m_without_isolation_reexecutes_isolated(tmp_path: Path) -> None:
    """An old shim or a manual `python -m bluevela.hooks` from a hostile directory: the entry
    re-executes itself with -I from / before importing anything from there."""
    cwd, py_env, canaries = plant(tmp_path)
    real = tmp_path / "real"
    for d in ("state", "spool", "metrics"):
        (real / d).mkdir(parents=True)
    hook_env = tmp_path / "hook.env"
    hook_env.write_text("".join(f"{k}={v}\n" for k, v in fixture_hook_env(
        real / "state", BV_SITE=str(REPO / "site.yaml"), BV_STATE_DIR=str(real / "state"),
        BV_SPOOL_DIR=str(real / "spool"), BV_METRICS_DIR=str(real / "metrics")).items()))
    # PYTHONPATH only: user-site .pth files run at interpreter start-up, before any code of
    # ours could re-execute (the shims' -I is what stops those; tested above).
    env = {"BV_HOOK_ENV": str(hook_env), "SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "78",
           "PYTHONPATH": py_env["PYTHONPATH"]}
    p = subprocess.run([sys.executable, "-m", "bluevela.hooks", "prolog"], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    ran = {k: c.read_text() for k, c in canaries.items() if c.exists()}
    assert not ran, f"planted code ran via {sorted(ran)}"
    assert (real / "spool" / "78.gpu001.prolog.json").is_file(), p.stderr


def test_root_site_lookup_never_reads_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "site.yaml").write_text("cluster: planted\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BV_SITE", raising=False)
    assert find_site_path(cwd=False) == ETC_SITE
    assert find_site_path() == Path("site.yaml")  # users' lookup is unchanged
    monkeypatch.setenv("BV_SITE", "/etc/other/site.yaml")
    assert find_site_path(cwd=False) == Path("/etc/other/site.yaml")
    monkeypatch.setenv("BV_SITE", "site.yaml")
    with pytest.raises(SiteConfigError, match="not an absolute path"):
        find_site_path(cwd=False)


def test_fixture_keys_make_a_warning_line() -> None:
    assert fixture_warning({"BV_SITE": "/etc/bluevela/site.yaml", "BV_NODE_CLASS": "h100"}) is None
    line = fixture_warning({"BV_NVML_SNAPSHOT": "/x/nvml.json", "BV_KMSG": "/x/kmsg",
                            "BV_FAKE_THING": "1", "BV_NODE_CLASS": "h100"})
    assert line is not None and "\n" not in line
    for part in ("BV_NVML_SNAPSHOT=/x/nvml.json", "BV_KMSG=/x/kmsg", "BV_FAKE_THING=1",
                 "BV_NODE_CLASS=h100", "not this node's hardware"):
        assert part in line


# -- one hook run at a time -----------------------------------------------------------------


def _node(tmp_path: Path, **extra: str) -> tuple[Path, Path]:
    real = tmp_path / "node"
    for d in ("state", "spool", "metrics"):
        (real / d).mkdir(parents=True, exist_ok=True)
    hook_env = tmp_path / "hook.env"
    hook_env.write_text("".join(f"{k}={v}\n" for k, v in fixture_hook_env(
        real / "state", BV_SITE=str(REPO / "site.yaml"), BV_STATE_DIR=str(real / "state"),
        BV_SPOOL_DIR=str(real / "spool"), BV_METRICS_DIR=str(real / "metrics"),
        **extra).items()))
    hook_env.chmod(0o644)
    return hook_env, real


def _hook(phase: str, hook_env: Path, job: int | None = None) -> subprocess.Popen[str]:
    env = {"BV_HOOK_ENV": str(hook_env), "SLURMD_NODENAME": "gpu001"}
    if job is not None:
        env["SLURM_JOB_ID"] = str(job)
    return subprocess.Popen([sys.executable, "-I", "-m", "bluevela.hooks", phase], env=env,
                            cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Holder:
    """Another hook run holding the node's hook lock (what a running hook does)."""

    def __init__(self, state: Path, what: str = "4242 healthcheck -") -> None:
        self.fd = os.open(state / "hook.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, what.encode() + b"\n", 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@pytest.fixture
def holder_factory() -> Iterator[list[Holder]]:
    held: list[Holder] = []
    yield held
    for h in held:
        h.release()


def test_healthcheck_skips_while_another_hook_runs(tmp_path: Path,
                                                   holder_factory: list[Holder]) -> None:
    hook_env, real = _node(tmp_path)
    holder_factory.append(Holder(real / "state", "4242 prolog 9"))
    t0 = time.monotonic()
    p = _hook("healthcheck", hook_env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "the prolog job 9 (pid 4242) is running: healthcheck skipped" in err, err
    assert time.monotonic() - t0 < 30
    assert not (real / "state" / "last_run.json").exists()  # nothing was checked


def test_prolog_waits_for_the_running_hook_then_runs(tmp_path: Path,
                                                     holder_factory: list[Holder]) -> None:
    hook_env, real = _node(tmp_path, BV_HOOK_LOCK_WAIT_S="60")
    h = Holder(real / "state")
    holder_factory.append(h)
    t0 = time.monotonic()
    p = _hook("prolog", hook_env, job=61)
    time.sleep(2.0)
    assert p.poll() is None  # waiting for the healthcheck
    assert not (real / "spool" / "61.gpu001.prolog.json").exists()
    h.release()
    out, err = p.communicate(timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 0, err
    assert "the healthcheck (pid 4242) is running: the prolog waits for it" in err, err
    assert took >= 2.0
    assert (real / "spool" / "61.gpu001.prolog.json").is_file()


def test_prolog_runs_after_a_bounded_wait_when_the_holder_hangs(
        tmp_path: Path, holder_factory: list[Holder]) -> None:
    hook_env, real = _node(tmp_path, BV_HOOK_LOCK_WAIT_S="1")
    holder_factory.append(Holder(real / "state"))
    p = _hook("prolog", hook_env, job=62)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "still holds the hook lock after 1 s (hung?): the prolog runs alongside it" in err
    assert (real / "spool" / "62.gpu001.prolog.json").is_file()


# -- on the real dev cluster ----------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_job_hooks_on_the_cluster_ignore_files_planted_in_slurmds_log_dir(
        devcluster: DevCluster, tmp_path: Path) -> None:
    """slurmd runs Prolog/Epilog from its log dir: plant a logging.py and a site.yaml there,
    run a job, and nothing of theirs runs or is read."""
    logdir = devcluster.state_dir / "log"
    canary = logdir / "PWNED-by-planted-logging"
    planted = [logdir / "logging.py", logdir / "site.yaml"]
    decoy = tmp_path / "decoy"
    for d in ("spool", "state", "metrics", "archive"):
        (decoy / d).mkdir(parents=True)
    devcluster.wait_idle(timeout=120)
    devcluster.resume_all()
    try:
        planted[0].write_text(_canary_module(canary))
        planted[1].write_text(PLANTED_SITE.format(d=decoy).replace(
            'h100: {nodes: "gpu[001-999]", gpus: 0}', 'cpu: {nodes: "node[1-99]", gpus: 0}'))
        p = devcluster.run(["sbatch", "--parsable", "--wait", "-N", "1", "-w", "node1",
                            "-o", "/dev/null", "--wrap", "true"], cwd=tmp_path, timeout=200)
        job = int(p.stdout.strip().split(";")[0])
        spool = Path(devcluster.env["BV_SPOOL_DIR"])
        deadline = time.monotonic() + 60
        epilog = spool / f"{job}.node1.epilog.json"
        while not epilog.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not canary.exists(), f"planted logging.py ran as root: {canary.read_text()}"
        for phase in ("prolog", "epilog"):
            report = json.loads((spool / f"{job}.node1.{phase}.json").read_text())
            names = [c["name"] for c in report["health"]["checks"]]
            assert names[:3] == ["gpu", "ib", "node"], (phase, names)  # the real site's tier
        assert not any(any((decoy / d).iterdir()) for d in ("spool", "state", "metrics"))
    finally:
        for f in [*planted, canary]:
            f.unlink(missing_ok=True)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_job_prolog_waits_while_another_hook_holds_the_node(
        devcluster: DevCluster, tmp_path: Path) -> None:
    """On the real cluster: while another hook run holds node2's hook lock (what a running
    healthcheck does), a job's prolog there waits; the job's script starts only after the
    holder is gone."""
    node = "node2"
    saved = devcluster.hook_env(node).read_text()
    state = devcluster.node_dir(node) / "var"
    devcluster.wait_idle(timeout=120)
    devcluster.resume_all()
    h = Holder(state, "4242 healthcheck -")
    try:
        devcluster.set_hook_env(node, BV_HOOK_LOCK_WAIT_S="120")
        started = tmp_path / "started"
        job = int(devcluster.run(
            ["sbatch", "--parsable", "-N", "1", "-w", node, "-o", "/dev/null", "--wrap",
             f"date +%s.%N > {started}"], cwd=tmp_path).stdout.strip().split(";")[0])
        time.sleep(4.0)
        assert not started.exists(), "the job started while another hook held the node"
        released = time.time()
        h.release()
        deadline = time.monotonic() + 90
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert started.exists(), f"job {job} never started after the lock was released"
        assert float(started.read_text()) >= released
        spool = Path(devcluster.env["BV_SPOOL_DIR"])
        assert (spool / f"{job}.{node}.prolog.json").is_file()
    finally:
        h.release()
        devcluster.hook_env(node).write_text(saved)
        devcluster.wait_idle(timeout=120)
