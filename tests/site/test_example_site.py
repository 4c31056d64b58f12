"""examples/site-h100.yaml, the production starting point docs/install.md points an admin at
(issue 35): it validates strictly (no key this bv does not know), its class is what the repo's
fixtures call an H100 node, and a job that names no class gets the class's 8 GPUs."""

from __future__ import annotations

from bluevela.launch.submit import build_request
from bluevela.site_file import load_site
from tests.conftest import REPO


def test_the_example_production_site_validates_and_asks_for_gpus() -> None:
    site = load_site(REPO / "examples" / "site-h100.yaml", strict=True)
    assert site.unknown_keys == ()
    h100 = site.node_class(name="h100")
    assert h100.gpus == 8 and len(h100.ib.ports) == 8
    req = build_request(site, "train.py", nodes=2)
    assert req.gpus_per_node == 8 and req.nproc_per_node == 8
    assert "#SBATCH --signal=B:USR1@300" in req.materialize().splitlines()
    assert site.health.actions == "audit"
