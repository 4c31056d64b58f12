"""Issue 16 §5: bv judges every XID as NVIDIA's XID catalog does.

tests/data/xid_catalog.tsv holds the catalog's 172 entries (code, mnemonic, description, the
GPUs it applies to, the immediate and investigatory resolution buckets), transcribed from
docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html (tests/data/README.md). Each
entry's kernel log line goes through the real gpu check (the recorded healthy H100 snapshot,
the line in a BV_KMSG file) and the verdict is held against the catalog's immediate action:

- RESET_GPU, RESTART_BM, RESTART_VM, CHECK_MECHANICALS, CONTACT_SUPPORT: CRITICAL (drain);
- RESTART_APP, IGNORE: not CRITICAL (WARNING: reported, the node stays in service);
- an entry the catalog marks Unused (not logged on A100 and later): WARNING, as any XID bv
  does not know;
- a workflow or no bucket: bv's choice, listed below WITH its reason, and the same list in
  docs/health.md. A verdict that differs from the rule and is not listed fails.

Old main (6c9e5ca): XIDs 46, 109, 110, 158 (RESET_GPU) were WARNINGs, XID 80 (RESTART_APP)
drained, and most of the catalog was unknown to bv.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from bluevela.health.checks import get_check
from bluevela.health.context import ProbeContext
from bluevela.health.result import CheckResult, Status
from bluevela.site import NodeClass, load_site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
CATALOG = REPO / "tests" / "data" / "xid_catalog.tsv"
FIXTURES = materialized()
HEALTHY = FIXTURES / "h100-healthy"
DRAIN = {"RESET_GPU", "RESTART_BM", "RESTART_VM", "CHECK_MECHANICALS", "CONTACT_SUPPORT"}
KEEP = {"RESTART_APP", "IGNORE"}
C, W = Status.CRITICAL, Status.WARNING

# Where bv's verdict is not the plain rule's: the catalog gives a workflow or no bucket, or
# marks the code Unused. code: (verdict, why). docs/health.md lists the same codes.
BV_CHOICES: dict[int, tuple[Status, str]] = {
    45: (W, "WORKFLOW_XID_45: alone a Fabric Manager restart, else follow the other XID"),
    48: (C, "WORKFLOW_XID_48: alone RESET_GPU; with XID 63/64 drain and reset"),
    74: (C, "WORKFLOW_NVLINK_ERR: the catalog's text: a GPU reset or node reboot clears it"),
    78: (C, "UPDATE_SWFW: an operator must update software before the GPU serves"),
    123: (C, "Unused on A100+; the catalog's bucket is CONTACT_SUPPORT (SPI flash write)"),
    **{code: (C, "WORKFLOW_NVLINK5_ERR: the line's Fatal word (a Non-fatal one: WARNING)")
       for code in range(144, 151)},
    154: (C, "XID_154: the recovery action the line names (None: WARNING)"),
    159: (C, "CHECK_UVM: RESET_GPU when UVM is used; every CUDA job uses nvidia-uvm"),
    162: (W, "no bucket: capability back"),
    163: (W, "no bucket: the catalog says no GPU reset is required"),
    164: (W, "no bucket: the catalog says monitor"),
    165: (W, "no bucket: power smoothing off, the GPU still computes"),
    166: (W, "no bucket: confidential-computing mode only"),
    167: (C, "no bucket: fatal PCIe timeout, the GPU unreachable as with XID 79"),
    168: (C, "no bucket: ECC on or a reboot needed first"),
    169: (C, "no bucket: micro-controller halt, as XID 62 (RESET_GPU)"),
    170: (W, "no bucket: confidential-computing mode only"),
    171: (C, "no bucket: detail line of XID 48"),
    172: (C, "no bucket: detail line of XID 48"),
}
# What the workflow lines look like in the kernel log (the catalog's own message formats).
LINE_TEXT = {
    154: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
    **{code: "NETIR_LINK_EVT Fatal XC0 i0 Link 04 (0x004505c6 0x00000000 0x00000000 0x00000000 "
             "0x00000000 0x00000000 0x00000000)" for code in range(144, 151)},
}


@dataclass(frozen=True)
class Entry:
    code: int
    mnemonic: str
    description: str
    applies: str
    immediate: str
    investigatory: str

    @property
    def unused(self) -> bool:
        return self.investigatory.startswith("N/A; Unused")


def catalog() -> list[Entry]:
    with CATALOG.open(encoding="utf-8") as fh:
        rows = [ln for ln in fh if not ln.startswith("#")]
    return [Entry(int(r["xid"]), r["mnemonic"], r["description"],
                  r["applies_a100_h100_b100_gb200"], r["immediate"], r["investigatory"])
            for r in csv.DictReader(rows, delimiter="\t")]


ENTRIES = catalog()


def expected(e: Entry) -> Status:
    if e.code in BV_CHOICES:
        return BV_CHOICES[e.code][0]
    if e.unused:
        return W
    if e.immediate in DRAIN:
        return C
    if e.immediate in KEEP:
        return W
    raise AssertionError(f"XID {e.code}: catalog bucket {e.immediate!r} has no rule and no "
                         "listed choice")


@pytest.fixture(scope="module")
def h100() -> NodeClass:
    return load_site(REPO / "site.yaml").node_class(name="h100")


def check_line(cls: NodeClass, tmp: Path, text: str) -> CheckResult:
    """The gpu check on the healthy recorded H100 with `text` as its only kernel log line."""
    kmsg = tmp / "dmesg.txt"
    kmsg.write_text("[   12.000000] usb 1-1: new device\n" + text + "\n", encoding="utf-8")
    ctx = ProbeContext(cls, "h100", root=HEALTHY / "root", nvml_snapshot=HEALTHY / "nvml.json",
                       kmsg=kmsg, phase="healthcheck")
    return get_check("gpu").run_once(ctx)


def xid_line(code: int, text: str = "") -> str:
    return f"NVRM: Xid (PCI:0000:5d:00): {code}, pid=4242, name=python3, {text or 'test'}"


def test_the_catalog_file_is_whole() -> None:
    codes = [e.code for e in ENTRIES]
    assert codes == list(range(1, 173))
    assert {e.immediate for e in ENTRIES} <= DRAIN | KEEP | {
        "WORKFLOW_XID_45", "WORKFLOW_XID_48", "WORKFLOW_NVLINK_ERR", "WORKFLOW_NVLINK5_ERR",
        "UPDATE_SWFW", "XID_154", "CHECK_UVM", "-"}
    by = {e.code: e for e in ENTRIES}
    # Spot checks against the page (the issue's examples).
    assert (by[46].immediate, by[109].immediate, by[110].immediate, by[158].immediate) == (
        "RESET_GPU",) * 4
    assert by[79].immediate == "RESTART_BM" and by[80].immediate == "RESTART_APP"
    assert by[54].immediate == "CHECK_MECHANICALS" and by[151].immediate == "RESTART_VM"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: f"xid{e.code}-{e.immediate}")
def test_each_xid_gets_the_catalogs_verdict(h100: NodeClass, tmp_path: Path,
                                            entry: Entry) -> None:
    r = check_line(h100, tmp_path, xid_line(entry.code, LINE_TEXT.get(entry.code, "")))
    want = expected(entry)
    assert r.status is want, (entry, r.summary)
    assert r.summary.startswith(f"XID {entry.code} on GPU3 (PCI 0000:5d:00)"), r.summary
    assert r.metrics["xid_count"] == 1


def test_bvs_table_carries_the_catalogs_resolution() -> None:
    from bluevela.health.checks.gpu import XID_TABLE

    by = {e.code: e for e in ENTRIES}
    for code, kind in XID_TABLE.items():
        assert kind.resolution == by[code].immediate, code
        assert kind.what and kind.action, code
    # Every entry NVIDIA lists as logged on A100 and later is known to bv by name.
    used = {e.code for e in ENTRIES if not e.unused}
    assert used <= set(XID_TABLE), sorted(used - set(XID_TABLE))


def test_every_exception_is_explained_in_the_docs() -> None:
    """docs/health.md's table of bv's own choices names each code of BV_CHOICES, and no
    other; the table's verdict matches."""
    text = (REPO / "docs" / "health.md").read_text(encoding="utf-8")
    start = text.index("#### Where bv decides")
    section = text[start:text.index("\n#", start + 5)]
    documented: dict[int, str] = {}
    for row in section.splitlines():
        m = re.match(r"\| ([0-9, -]+) \| [^|]+ \| (CRITICAL|WARNING) \| ", row)
        if m:
            for part in m.group(1).split(","):
                lo, _, hi = part.strip().partition("-")
                for code in range(int(lo), int(hi or lo) + 1):
                    documented[code] = m.group(2)
    assert documented == {code: s.name for code, (s, _) in BV_CHOICES.items()}


def test_xid_154_follows_the_recovery_action_it_names(h100: NodeClass, tmp_path: Path) -> None:
    for action, status in (("0x2 (Node Reboot Required)", C), ("0x4 (Drain and Reset)", C),
                           ("0x3 (Drain P2P)", C), ("0x0 (None)", W)):
        r = check_line(h100, tmp_path, xid_line(
            154, f"GPU recovery action changed from 0x1 (GPU Reset Required) to {action}"))
        assert r.status is status, (action, r.summary)
    r = check_line(h100, tmp_path, xid_line(154, "GPU recovery action changed from 0x0 (None) "
                                                 "to 0x2 (Node Reboot Required)"))
    assert "recovery action Node Reboot Required" in r.summary
    # A line bv cannot read fails closed.
    assert check_line(h100, tmp_path, xid_line(154, "garbled")).status is C


def test_nvlink5_xids_follow_the_drivers_fatal_word(h100: NodeClass, tmp_path: Path) -> None:
    nonfatal = xid_line(149, "NETIR_BER_EVENT Non-fatal XC0 i0 Link 05 (0x00260026 0x00000001)")
    assert check_line(h100, tmp_path, nonfatal).status is W
    fatal = xid_line(145, "RLW_REMAP Fatal XC1 i0 Link 07 (0x00000082 0x00000040)")
    r = check_line(h100, tmp_path, fatal)
    assert r.status is C and "NVLink RLW error (fatal)" in r.summary
    # Both on one GPU: the fatal one drains.
    kmsg = tmp_path / "two.txt"
    kmsg.write_text(nonfatal + "\n" + xid_line(149, "NETIR_LINK_EVT Fatal XC0 i0 Link 05 (0x1)")
                    + "\n", encoding="utf-8")
    ctx = ProbeContext(h100, "h100", root=HEALTHY / "root", nvml_snapshot=HEALTHY / "nvml.json",
                       kmsg=kmsg)
    assert get_check("gpu").run_once(ctx).status is C


def test_the_issues_examples(h100: NodeClass, tmp_path: Path) -> None:
    """RESET_GPU XIDs drain (the next job would fail); the one NVIDIA calls an application
    error does not. Old main: 46/109/110/158 WARNING, 80 CRITICAL."""
    for code in (46, 109, 110, 158):
        r = check_line(h100, tmp_path, xid_line(code))
        assert r.status is C and "reset the GPU" in r.summary, (code, r.summary)
    r = check_line(h100, tmp_path, xid_line(80))
    assert r.status is W and "restart it" in r.summary, r.summary
