"""bluevela/launch/rdzv_guard.py: torchrun's rendezvous state unpickled through an allow-list,
and when the node agent uses it. (The attack through a real TCPStore and a real torchrun:
tests/test_rdzv_secret.py.)"""

from __future__ import annotations

import pickle
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bluevela.launch.rdzv_guard import guarded_argv, guarded_pickle, install, loads


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_the_real_state_round_trips() -> None:
    dr = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    state = dr._RendezvousState()
    node = dr._NodeDesc("gpu001", 4242, 0)
    state.round, state.complete = 3, True
    state.deadline = datetime.now(UTC) + timedelta(seconds=30)
    state.participants[node] = 0
    state.wait_list.add(dr._NodeDesc("gpu002", 17, 0))
    state.redundancy_list.add(node)
    state.last_heartbeats[node] = datetime.now(UTC)
    back = loads(pickle.dumps(state))
    assert isinstance(back, dr._RendezvousState)
    assert vars(back) == vars(state)


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_that_runs_code_is_refused(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps(Payload(marker), protocol=protocol)
    with pytest.raises(pickle.UnpicklingError, match=r"exec is not part of torchrun.s rendezvous state"):
        loads(data)
    assert not marker.exists()
    pickle.loads(data)  # what torch's own pickle.loads does with it
    assert marker.exists()


def test_install_puts_the_guard_where_torch_unpickles(tmp_path: Path) -> None:
    dr = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    saved = dr.pickle
    try:
        install()
        assert dr.pickle is not pickle and dr.pickle.loads is loads
        assert dr.pickle.dumps is pickle.dumps and dr.pickle.PickleError is pickle.PickleError
        with pytest.raises(pickle.PickleError):  # what torchrun catches: "state is corrupt"
            dr.pickle.loads(pickle.dumps(Payload(tmp_path / "x")))
        assert guarded_pickle().UnpicklingError is pickle.UnpicklingError
    finally:
        dr.pickle = saved


def _script(path: Path, body: str) -> Path:
    path.write_text(body)
    path.chmod(0o755)
    return path


TORCHRUN = ("# -*- coding: utf-8 -*-\nimport re\nimport sys\nfrom torch.distributed.run import "
            "main\nif __name__ == '__main__':\n    sys.exit(main())\n")


def test_guarded_argv_only_for_torchs_torchrun_of_this_python(tmp_path: Path) -> None:
    python = str(tmp_path / "venv" / "bin" / "python3")
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    torchrun = _script(bindir / "torchrun", f"#!{bindir}/python\n{TORCHRUN}")
    argv = ["torchrun", "--nnodes=2", "train.py", "--lr", "1"]
    assert guarded_argv(argv, python, path=str(bindir)) == [
        python, "-P", "-m", "bluevela.launch.rdzv_guard", str(torchrun), *argv[1:]]
    # Another environment's torchrun: bluevela may not import there; run it as it is.
    other = tmp_path / "other"
    other.mkdir()
    _script(other / "torchrun", f"#!/opt/elsewhere/bin/python\n{TORCHRUN}")
    assert guarded_argv(argv, python, path=str(other)) is None
    # Not torch's torchrun (a site's wrapper, bv's test stand-ins), missing, or empty.
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    _script(wrap / "torchrun", f"#!{bindir}/python\nimport os\n")
    assert guarded_argv(argv, python, path=str(wrap)) is None
    assert guarded_argv(["no-such-torchrun"], python, path=str(bindir)) is None
    # A pyenv shim runs the same name of the current version: the torchrun beside `python`.
    shims = tmp_path / "shims"
    shims.mkdir()
    _script(shims / "torchrun", '#!/usr/bin/env bash\nprogram="${0##*/}"\n'
            'exec "/root/.pyenv/libexec/pyenv" exec "$program" "$@"\n')
    assert guarded_argv(argv, python, path=str(shims)) == [
        python, "-P", "-m", "bluevela.launch.rdzv_guard", str(torchrun), *argv[1:]]
    assert guarded_argv([], python) is None


def test_this_pythons_torchrun_is_guarded() -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip(f"no {torchrun}")
    argv = guarded_argv([str(torchrun), "x.py"])
    assert argv is not None and argv[3] == "bluevela.launch.rdzv_guard"
