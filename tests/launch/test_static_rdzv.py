"""torch's static rendezvous for every step without in-place restarts (issue 37): the
supervisor knows the step's world, so each node's agent is told its node rank and the node
count in its ``go`` and torchrun gets them (``PET_NODE_RANK``, ``--nnodes``, the
``--rdzv-backend=static`` the supervisor chose), instead of torch's c10d join loop that polls
the store once a second. The real torchruns (the store's linger, in-place restarts) are in
tests/launch/test_rdzv_guard.py."""

from __future__ import annotations

import pytest

from bluevela.errors import LaunchError
from bluevela.goodput.outcome import StepEnd
from bluevela.launch.agent import STATIC_FLAG, Agent, endpoint_env, parse_go
from bluevela.launch.events_log import EventLog
from bluevela.launch.request import SubmitRequest, rdzv_flag
from bluevela.launch.step import Endpoints, Signals, StepState, go_message
from bluevela.launch.supervisor import STATIC_ENV, Options, Supervisor
from tests.step_script import FakeTime, NodeScript, StepDriver


def test_each_agent_is_told_its_node_rank_and_the_node_count(
        io: tuple[Signals, Endpoints]) -> None:
    """The real Step: the node rank is the node's place in the step (the store's host, the
    step's first node, is 0), whatever order the hellos come in; every go carries the port
    the first node's agent drew and the step's node count."""
    signals, ends = io
    nodes = ["n3", "n1", "n2"]  # a relaunch: the spare n3 leads, holding the store
    scripts = {"n3": NodeScript(hello_at=0.5, done_at=2.0), "n1": NodeScript(done_at=2.0),
               "n2": NodeScript(hello_at=0.2, done_at=2.0)}
    driver = StepDriver(nodes, scripts, signals, ends, EventLog(None, "h"), FakeTime())
    assert driver.run().kind is StepEnd.OK
    port = driver.step.st.rdzv_port
    for rank, node in enumerate(nodes):
        assert driver.agents[node].gos == [
            {"t": "go", "port": port, "node_rank": rank, "nnodes": 3}], node
    # A shrunk step (a new step, fewer nodes): its own ranks and count.
    st = StepState(nodes=["n2"], started=0.0)
    assert go_message(st, "n2", 4242) == {"t": "go", "port": 4242, "node_rank": 0,
                                          "nnodes": 1}


def test_the_agent_reads_the_go_and_hands_torchrun_its_node_rank() -> None:
    assert parse_go({"t": "go", "port": 4242, "node_rank": 1, "nnodes": 2}) == (4242, 1, 2)
    assert parse_go({"t": "go", "port": 4242}) == (4242, None, None)  # torchrun's default 0
    for bad in ({"port": 0, "node_rank": 0, "nnodes": 1}, {"port": 4242, "node_rank": 2,
                                                            "nnodes": 2},
                {"port": 4242, "node_rank": -1, "nnodes": 2},
                {"port": 4242, "node_rank": True, "nnodes": 2},
                {"port": 4242, "node_rank": 0}, {"port": 4242, "nnodes": 2},
                {"port": "4242", "node_rank": 0, "nnodes": 1}):
        assert parse_go(bad) is None, bad
    assert endpoint_env("n3", 4242, 1) == {"PET_RDZV_ENDPOINT": "n3:4242", "PET_NODE_RANK": "1"}
    assert endpoint_env("n3", 4242) == {"PET_RDZV_ENDPOINT": "n3:4242"}

    class NoStart(Agent):
        def _start(self, port: int) -> None:
            self.started_with = port

    static = NoStart(None, "n1", ["torchrun", "--nnodes=2", STATIC_FLAG], {})  # type: ignore[arg-type]
    static._on_msg({"t": "go", "port": 4242, "node_rank": 1, "nnodes": 2})
    assert (static.started_with, static.node_rank, static.nnodes) == (4242, 1, 2)
    assert static.static_rank() == 1
    # c10d (a step with --max-restarts) assigns its own ranks: none given (torchrun warns).
    c10d = NoStart(None, "n1", ["torchrun", "--nnodes=2", "--rdzv-backend=c10d"], {})  # type: ignore[arg-type]
    c10d._on_msg({"t": "go", "port": 4242, "node_rank": 1, "nnodes": 2})
    assert c10d.static_rank() is None
    wrong = NoStart(None, "n1", ["torchrun", STATIC_FLAG], {})  # type: ignore[arg-type]
    wrong._on_msg({"t": "go", "port": 4242, "node_rank": 5, "nnodes": 2})
    assert not hasattr(wrong, "started_with")  # a malformed go is ignored, as before


@pytest.mark.parametrize("word", [
    "--node-rank=1", "--node_rank", "--master-addr=h", "--master_port=1", "--master-port",
    "--node-r=1", "--node", "--master-a=h", "--rdzv-b=static", "--nnode=2"])
def test_the_static_rendezvous_flags_stay_bvs(word: str) -> None:
    """A site's torchrun command cannot name a node's rank or the store (bv's go does), nor
    sneak a rendezvous flag past the check as an abbreviation torchrun's argparse accepts."""
    assert rdzv_flag(word)
    with pytest.raises(LaunchError, match="bv sets the rendezvous per step"):
        SubmitRequest(script="train.py", torchrun=("torchrun", word))


def test_other_torchrun_options_and_the_jobs_static_env() -> None:
    for word in ("--nproc-per-node=2", "--max-restarts=1", "--rdzv-conf=timeout=60",
                 "--log-dir=x", "--local-ranks-filter=0", "--no-python", "--monitor-interval=1"):
        assert not rdzv_flag(word), word
    SubmitRequest(script="train.py", torchrun=("torchrun", "--monitor-interval=1"))
    # The job's own PET_NODE_RANK / PET_MASTER_* never reach a step (they would make another
    # node the store's host).
    sup = Supervisor(Options(nodes=1, torchrun=["torchrun", "train.py"]), {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "evil",
                            "PET_MASTER_PORT": "1", "PATH": "/bin"})
    assert not set(STATIC_ENV) & set(sup.env)
