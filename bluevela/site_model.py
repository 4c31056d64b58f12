"""The site model: what site.yaml describes, validated and queried.

Used through `bluevela.site`, which adds `load_site` (bluevela/site_file.py finds, reads and
validates the file: the search order, the `PATH:LINE` errors, the cache); this module imports
no reader. Paths can be overridden per process by `BV_SPOOL_DIR`, `BV_ARCHIVE_DIR`, `BV_STATE_DIR` and
`BV_METRICS_DIR` (the dev cluster gives every node its own), the node class by `BV_NODE_CLASS`.

The model is frozen standard dataclasses: pydantic validates them (constraints are
`annotated_types` metadata, cross-field rules live in `__post_init__`) but is imported only
when a file is actually parsed. A validated site is cached, so the prolog and `bv submit`
normally never import pydantic or parse YAML (docs/site-yaml.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from bluevela.errors import SiteConfigError

if TYPE_CHECKING:
    from annotated_types import Ge, Gt, Le, MinLen

    NonNegInt = Annotated[int, Ge(0)]
    NonNegFloat = Annotated[float, Ge(0)]

logger = logging.getLogger(__name__)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Unknown keys fail validation; the file reader (site_file.parse_site) then drops and reports
# them, or, for `bv site validate`, makes them errors: a typo must not pass silently, and a
# newer bv's key must not make an older node's hooks stop checking.
_STRICT = {"extra": "forbid"}


def _constraint(*_args: Any) -> None:
    return None


def _annotation_names(*, real: bool) -> dict[str, Any]:
    """What the field annotations name (they are strings: `from __future__ import annotations`).

    pydantic needs the real annotated_types constraints (`real`); rebuilding a cached site only
    needs the types (`typing.get_type_hints` drops `Annotated` metadata), so a cache hit (the
    `bv submit` path) never imports annotated_types: ~6 ms of a ~80 ms `bv submit --dry-run`.
    """
    if real:
        from annotated_types import Ge, Gt, Le, MinLen

        ge: Any = Ge
        names: dict[str, Any] = {"Ge": Ge, "Gt": Gt, "Le": Le, "MinLen": MinLen}
    else:
        ge = _constraint
        names = dict.fromkeys(("Ge", "Gt", "Le", "MinLen"), _constraint)
    names["NonNegInt"] = Annotated[int, ge(0)]
    names["NonNegFloat"] = Annotated[float, ge(0)]
    return names


class _Checked:
    """Annotated metadata: run `fn` after pydantic's own validation of the field, so its error
    carries the field's location (and line). pydantic_core is imported only when validating."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.fn, handler(source))


def _absolute(v: Path) -> Path:
    if not v.is_absolute():
        raise ValueError("must be an absolute path")
    return v


def _env_map(v: dict[str, str]) -> dict[str, str]:
    for key, value in v.items():
        if not _ENV_NAME.match(key):
            raise ValueError(f"invalid environment variable name {key!r}")
        if "\n" in value or "\0" in value:
            raise ValueError(f"value of {key} contains a newline or NUL")
    return v


def _port_list(v: list[str]) -> list[str]:
    for p in v:
        if not re.match(r"^[A-Za-z0-9_.-]+/[0-9]+$", p):
            raise ValueError(f"port {p!r} is not '<hca>/<port>'")
    return v


def _hostlist_expr(v: str) -> str:
    import hostlist

    try:
        hostlist.expand_hostlist(v)
    except hostlist.BadHostlist as exc:
        raise ValueError(f"bad hostlist {v!r}: {exc}") from exc
    return v


AbsPath = Annotated[Path, _Checked(_absolute)]


@dataclass(frozen=True)
class Paths:
    """Where bluevela keeps its files. All absolute."""

    __pydantic_config__ = _STRICT

    spool: AbsPath = Path("/var/spool/bluevela")
    archive: AbsPath = Path("/var/lib/bluevela/archive")
    state: AbsPath = Path("/var/lib/bluevela/state")
    metrics: AbsPath = Path("/var/lib/node_exporter/textfile")


def _option_names(v: list[str]) -> list[str]:
    """Long option names without their dashes (`container-image`)."""
    for name in v:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,63}", name):
            raise ValueError(f"{name!r} is not a long option name without dashes "
                             "(e.g. container-image)")
    return v


def _module_names(v: list[str]) -> list[str]:
    """Dotted Python module names (`lightning.pytorch`), at least one."""
    if not v:
        raise ValueError("must name at least one module (torch)")
    for name in v:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
            raise ValueError(f"{name!r} is not a module name (e.g. lightning.pytorch)")
    return v


def _python_command(v: str) -> str:
    """A command name or an absolute path, without control characters."""
    plain = not any(ord(c) < 0x20 or ord(c) == 0x7F for c in v)
    if not plain or not (re.fullmatch(r"[A-Za-z0-9_.+-]+", v) or v.startswith("/")):
        raise ValueError("must be a command name (python3) or an absolute path")
    return v


@dataclass(frozen=True)
class Launch:
    """Defaults for `bv submit`."""

    __pydantic_config__ = _STRICT

    # Deprecated and ignored (issue 16): the supervisor picks a free rendezvous port on each
    # step's first node, since a fixed one can be taken first by another user. Still accepted
    # so that site files written before it load.
    rdzv_port: Annotated[int, Ge(1024), Le(65535)] = 29500
    torchrun: Annotated[list[str], MinLen(1)] = field(default_factory=lambda: ["torchrun"])
    max_restarts: Annotated[int, Ge(0), Le(100)] = 0
    requeue: bool = True
    output: str = "bv-%j.out"
    env: Annotated[dict[str, str], _Checked(_env_map)] = field(default_factory=dict)
    submit_retry_s: NonNegFloat = 120.0  # how long to retry an unreachable slurmctld
    default_partition: str | None = None
    # SIGUSR1 this long before the time limit (checkpoint, then requeue); 0: no signal.
    signal_before_s: Annotated[int, Ge(0), Le(65535)] = 120
    spare_nodes: Annotated[int, Ge(0)] = 0  # hot spare nodes added to every allocation
    hang_timeout_s: NonNegFloat = 0.0  # end+requeue when no rank reports progress; 0: off
    # A lost node without a spare: grow the job by one node (needs Slurm's
    # permit_job_expansion; docs/install.md) waiting at most this long, else requeue; 0: off.
    grow_deadline_s: Annotated[float, Ge(0), Le(3600)] = 0.0
    # torchrun through bv's rendezvous guard (launch/rdzv_guard.py); "optional": a torchrun
    # the guard cannot run (a site's wrapper, another environment's) runs unguarded, said in
    # the job's output, instead of failing the step.
    rdzv_guard: Literal["required", "optional"] = "required"
    # The warm start (launch/warm.py): a pre-imported parent on every node of the job forks
    # each step's ranks, so a relaunch pays no interpreter start and no torch import.
    warm_start: bool = False
    # What each warm parent imports before it is needed (BV_WARM_PREIMPORT; a job's own
    # `--env BV_WARM_PREIMPORT=...` wins): a framework imported in the ranks instead is on the
    # relaunch's path (lightning.pytorch: ~2.4 s after torch on the dev cluster). Only modules
    # whose import starts no device context and no thread (the ranks are forked after it).
    warm_preimport: Annotated[list[str], _Checked(_module_names)] = field(
        default_factory=lambda: ["torch", "torch._dynamo"])
    # The job's Python (the batch script's `exec` line; `bv submit --python`): a command on
    # the job's PATH or an absolute path, >= 3.11 with this bluevela (checked at submit).
    python: Annotated[str, _Checked(_python_command)] = "python3"
    # The node class a job gets when it gives neither --class nor --gpus-per-node (its GPUs
    # become the job's --gpus-per-node); None: no GPUs unless asked.
    default_class: str | None = None
    # sbatch options the site's SPANK plugins add (pyxis: container-image, container-mounts,
    # ...): `bv submit --sbatch-arg=--container-image=...` accepts them. Names only; one that
    # bv sets itself or refuses stays refused.
    spank_options: Annotated[list[str], _Checked(_option_names)] = field(default_factory=list)


def _check_names(v: list[str]) -> list[str]:
    """Tier check names must be registered checks: the built-in ones by the registry's static
    table (no check is imported) and any registered since. The registry is imported only when
    a file is parsed, never on a cache hit."""
    from bluevela.checks_registry import known_names

    known = known_names()
    unknown = [n for n in v if n not in known]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(sorted(known))})")
    return v


def _drain_prefix(v: str) -> str:
    """Our drains are told from operators' by this prefix: it must be distinctive."""
    if not re.fullmatch(r"[^\s]*[A-Za-z][^\s]*:", v):
        raise ValueError(f"drain_prefix {v!r} must be non-empty, contain a letter, end with ':' "
                         "and have no whitespace (e.g. 'bv:'): every drain whose reason starts "
                         "with it counts as bluevela's, to resume and for the fleet breaker")
    return v


@dataclass(frozen=True)
class Tier:
    __pydantic_config__ = _STRICT

    checks: Annotated[list[str], _Checked(_check_names)]
    cap_s: Annotated[float, Gt(0)]  # hard cap on the whole run
    check_timeout_s: Annotated[float, Gt(0)]  # each check's own timeout


def _default_tiers() -> dict[str, Tier]:
    return {
        "quick": Tier(checks=["gpu", "ib", "node"], cap_s=5.0, check_timeout_s=3.0),
        "full": Tier(checks=["gpu", "ib", "node", "nccl"], cap_s=180.0, check_timeout_s=120.0),
    }


@dataclass(frozen=True)
class DcgmOptions:
    """Where `dcgmi diag` runs (the `dcgm` check), by level (0: not there; 1 ~ seconds,
    2 ~ 2 min, 3 ~ 30 min, 4 ~ hours), each bounded by its own timeout."""

    __pydantic_config__ = _STRICT

    healthcheck_level: Annotated[int, Ge(0), Le(4)] = 0  # in every healthcheck
    before_resume_level: Annotated[int, Ge(0), Le(4)] = 0  # before bluevela resumes its drain
    nightly_level: Annotated[int, Ge(0), Le(4)] = 0  # in each node's nightly job
    healthcheck_timeout_s: Annotated[float, Gt(0)] = 45.0  # slurmd kills it at 60 s
    before_resume_timeout_s: Annotated[float, Gt(0)] = 600.0
    nightly_timeout_s: Annotated[float, Gt(0)] = 3600.0


@dataclass(frozen=True)
class Health:
    """How the hooks run the checks."""

    __pydantic_config__ = _STRICT

    tiers: dict[str, Tier] = field(default_factory=_default_tiers)
    dcgm: DcgmOptions = field(default_factory=DcgmOptions)
    nccl_freshness_h: NonNegFloat = 6.0  # the prolog reruns nccl when older; 0 = never
    retries: Annotated[int, Ge(1), Le(10)] = 3  # noisy measurements: pass if any try passes
    drain_timeout_s: Annotated[float, Gt(0)] = 5.0
    # The most partitions one node is in: each adds the fleet breaker's slot creates to a
    # drain, so the healthcheck's run cap is cut to keep the drain within slurmd's 60 s
    # (hooks/budget.py; `bv site validate --cluster` compares it with sinfo).
    partitions_per_node: Annotated[int, Ge(1), Le(64)] = 1
    fleet_breaker_pct: Annotated[float, Ge(0), Le(100)] = 15.0
    drain_prefix: Annotated[str, _Checked(_drain_prefix)] = "bv:"
    # enforce: drain/resume/hold; audit: check and report only; off: the hooks check nothing.
    # A node's /etc/bluevela/actions overrides it (bluevela.fleet.nodestate, the action gate).
    actions: Literal["enforce", "audit", "off"] = "enforce"

    def __post_init__(self) -> None:
        for name in ("quick", "full"):
            if name not in self.tiers:
                raise ValueError(f"health.tiers needs a '{name}' tier")


@dataclass(frozen=True)
class IBExpect:
    """The InfiniBand ports a node class must have."""

    __pydantic_config__ = _STRICT

    # '<hca>/<port>', e.g. mlx5_0/1
    ports: Annotated[list[str], _Checked(_port_list)] = field(default_factory=list)
    rate_gbps: NonNegFloat = 0.0
    link_layer: Literal["InfiniBand", "Ethernet"] = "InfiniBand"
    # Each expected port's HCA at its PCIe maximum (current_link_width/speed = max_*).
    pcie_at_max: bool = True
    # GPUDirect RDMA: "peermem" (nvidia_peermem or nv_peer_mem loaded), "dmabuf" (NVIDIA's
    # open kernel module on Linux >= 5.12), "any" (either), "off" (not checked).
    gpudirect: Literal["off", "peermem", "dmabuf", "any"] = "off"


def _default_nvlink_max_increase() -> dict[str, int]:
    # A link recovery is a retrain (traffic stalls); replays and CRC errors come in bursts.
    return {"recovery": 0, "replay": 1000, "crc_flit": 1000, "crc_data": 100}


def _default_max_throttle_pct() -> dict[str, float]:
    # A busy H100 sits at its power cap much of the time; thermal throttling should be rare.
    return {"power": 90.0, "thermal": 5.0}


@dataclass(frozen=True)
class GPUThresholds:
    __pydantic_config__ = _STRICT

    max_temp_c: float = 87.0
    max_uncorrected_ecc_volatile: int = 0
    max_uncorrected_ecc_aggregate: int = 0
    max_retired_pages: int = 60  # NVIDIA's RMA criterion
    allow_leftover_processes: bool = False
    require_persistence_mode: bool = True
    # XIDs count when their kernel record is at most this old (0: every record since boot).
    xid_window_s: NonNegFloat = 3600.0
    # A hardware slowdown or a compute process is read again after this long and counts
    # only when both readings show it (0: one reading decides).
    recheck_s: Annotated[float, Ge(0), Le(2)] = 1.0
    # NVLink: links per GPU that must be up (0: not checked; 18 on H100/H200 SXM), and error
    # counters (replay, recovery, crc_flit, crc_data) risen more than this since the last
    # reading (WARNING).
    nvlinks: NonNegInt = 0
    nvlink_max_increase: dict[str, int] = field(default_factory=_default_nvlink_max_increase)
    # An NVSwitch system: each GPU's fabric (NVML GpuFabricInfo) must be COMPLETED / SUCCESS.
    nvswitch: bool = False
    # ECC by location: SRAM uncorrectable (volatile) over this is CRITICAL; corrected errors
    # (volatile, since the last driver load) over these are WARNING (None: not judged).
    max_sram_uncorrected: NonNegInt = 0
    max_sram_corrected_volatile: NonNegInt | None = None
    max_dram_corrected_volatile: NonNegInt | None = None
    # Row remapper histogram: banks with few or no spare rows left (low + none) over this: WARNING.
    max_row_remap_low_banks: NonNegInt = 0
    # Share of time (%) throttled since the last reading, from NVML's violation counters
    # (power, thermal, sync_boost, board_limit, low_utilization, reliability, total_app_clocks,
    # total_base_clocks): WARNING over these, judged when that reading is old enough.
    max_throttle_pct: dict[str, float] = field(default_factory=_default_max_throttle_pct)
    throttle_min_interval_s: NonNegFloat = 60.0
    # What the class expects (None: not checked): enforced power limit, application clocks.
    power_limit_w: NonNegFloat | None = None
    app_clock_sm_mhz: NonNegInt | None = None
    app_clock_mem_mhz: NonNegInt | None = None


def _default_max_counters() -> dict[str, int]:
    return {"symbol_error": 1000, "link_downed": 10, "link_error_recovery": 100,
            "port_rcv_errors": 1000, "local_link_integrity_errors": 10,
            "excessive_buffer_overrun_errors": 10}


def _default_max_increase() -> dict[str, int]:
    return {"symbol_error": 10, "link_downed": 0, "link_error_recovery": 0, "port_rcv_errors": 10,
            "local_link_integrity_errors": 0,
            # A lossless fabric overran a receive buffer: credit/flow control is broken.
            "excessive_buffer_overrun_errors": 0}


def _default_max_rate_per_h() -> dict[str, float]:
    # counters/ and hw_counters/ names alike; a rate over these is WARNING.
    return {"symbol_error": 60.0, "port_rcv_errors": 60.0, "port_xmit_discards": 1000.0,
            "excessive_buffer_overrun_errors": 1.0, "rnr_nak_retry_err": 10.0,
            "local_ack_timeout_err": 60.0, "req_cqe_error": 60.0}


@dataclass(frozen=True)
class IBThresholds:
    """Absolute ceilings for error counters, and for their increase since the last reading."""

    __pydantic_config__ = _STRICT

    max_counters: dict[str, int] = field(default_factory=_default_max_counters)
    max_increase: dict[str, int] = field(default_factory=_default_max_increase)
    # Error rates per hour since the last reading (WARNING over these), judged only when that
    # reading is at least `rate_min_interval_s` old (one error in 10 s is not 360/h).
    max_rate_per_h: dict[str, float] = field(default_factory=_default_max_rate_per_h)
    rate_min_interval_s: NonNegFloat = 300.0
    # `max_increase` holds over up to this long since the last reading; over a longer interval
    # (a days-long job between its prolog and epilog) the increase is judged as a rate per
    # this window (CRITICAL only at allowed + 1 per window on average; else WARNING).
    increase_window_s: Annotated[float, Gt(0)] = 3600.0


@dataclass(frozen=True)
class NodeThresholds:
    __pydantic_config__ = _STRICT

    min_mem_available_gib: NonNegFloat = 1.0
    min_free_gib: dict[str, float] = field(default_factory=lambda: {"/tmp": 1.0})
    required_paths: list[str] = field(default_factory=list)
    required_mounts: list[str] = field(default_factory=list)
    required_devices: list[str] = field(default_factory=list)
    # Each required mount must answer statvfs + a directory read in a forked child within
    # this bound (a hung Lustre/GPFS mount is still in /proc/mounts); 0: not probed.
    mount_probe_timeout_s: Annotated[float, Ge(0), Le(60)] = 2.0
    # Directories (on required mounts, writable by root) where the probe also writes, reads
    # back and removes a small file.
    mount_write_dirs: list[str] = field(default_factory=list)
    # Process names (/proc/<pid>/stat comm, 15 characters) that must be running.
    required_services: list[str] = field(default_factory=list)
    # The user (name in <root>/etc/passwd, or a uid) whose process stands for a service; a
    # service not listed here must run as root. A user's process of the same name is not it.
    service_owners: dict[str, str] = field(default_factory=dict)
    # A user process in uninterruptible sleep (D) in every reading for this long: WARNING.
    max_d_state_s: NonNegFloat = 600.0
    # EDAC: uncorrectable memory errors since boot over this: CRITICAL; corrected per hour
    # since the last reading over this: WARNING.
    max_edac_ue: NonNegInt = 0
    max_edac_ce_per_h: NonNegFloat = 100.0
    # |kernel clock offset| (adjtimex) over this, or the kernel clock unsynchronized: WARNING;
    # 0: not checked.
    max_clock_offset_ms: NonNegFloat = 0.0
    # `dcgmi diag -r <level>` of the dcgm check (1 ~ seconds, 2 ~ 2 min, 3 ~ 30 min).
    dcgm_level: Annotated[int, Ge(1), Le(4)] = 1


@dataclass(frozen=True)
class NCCLThresholds:
    """All_reduce bus bandwidth inside the node at a stated size (nccl-tests definition)."""

    __pydantic_config__ = _STRICT

    size_bytes: Annotated[int, Gt(0)] = 1 << 30
    iters: Annotated[int, Ge(1)] = 20
    warmup: NonNegInt = 5
    min_busbw_gbs: NonNegFloat = 0.0
    procs: Annotated[int, Ge(1)] | None = None  # ranks on a CPU node (default 2)


@dataclass(frozen=True)
class BenchThresholds:
    """Absolute acceptance floors for the nightly benchmarks (units in the names)."""

    __pydantic_config__ = _STRICT

    gemm_tflops: float = 0.0
    hbm_gbs: float = 0.0
    h2d_gbs: float = 0.0
    d2h_gbs: float = 0.0
    allreduce_busbw_gbs: float = 0.0
    pair_busbw_gbs: float = 0.0
    mpi_bw_gbs: float = 0.0
    mpi_lat_us_max: float = 0.0  # 0 = no ceiling
    regression_nights: Annotated[int, Ge(1)] = 7
    regression_tolerance_pct: Annotated[float, Ge(0), Le(100)] = 10.0
    # The message sizes the floors above apply to (the largest size of each sweep);
    # 0 = the measurement's default for the node's backend (CUDA or CPU).
    allreduce_size_bytes: NonNegInt = 0
    pair_size_bytes: NonNegInt = 0
    mpi_size_bytes: NonNegInt = 0


VERSION_FIELDS = ("driver", "cuda", "vbios", "hca_fw", "kernel")
VersionField = Literal["driver", "cuda", "vbios", "hca_fw", "kernel"]


@dataclass(frozen=True)
class VersionPins:
    """Versions a node class must run (the `versions` check): each an exact string or a list
    of allowed ones (quote them in YAML: `cuda: "12.4"`); None: not pinned. A node that
    differs is WARNING, CRITICAL for the fields named in `critical`."""

    __pydantic_config__ = _STRICT

    driver: str | list[str] | None = None  # NVIDIA driver (NVML), e.g. "550.90.07"
    cuda: str | list[str] | None = None  # CUDA driver API version, e.g. "12.4"
    vbios: str | list[str] | None = None  # every GPU's VBIOS, e.g. "96.00.89.00.01"
    hca_fw: str | list[str] | None = None  # every HCA's firmware (sysfs fw_ver)
    kernel: str | list[str] | None = None  # /proc/sys/kernel/osrelease
    critical: list[VersionField] = field(default_factory=list)

    def __post_init__(self) -> None:
        loose = [f for f in self.critical if self.allowed(f) is None]
        if loose:
            raise ValueError(f"versions.critical names {', '.join(loose)}, not pinned")

    def allowed(self, name: str) -> tuple[str, ...] | None:
        """The allowed values of field `name`; None when it is not pinned."""
        value = getattr(self, name)
        if value is None:
            return None
        return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class LocalCheckpoint:
    """A node class's node-local checkpoint tier (bluevela/ckpt, docs/checkpoints.md)."""

    __pydantic_config__ = _STRICT

    dir: AbsPath | None = None  # e.g. an NVMe mount or /dev/shm; None: no node-local tier
    budget_gb: NonNegFloat = 0.0  # the tier's room on one node, all ranks; 0: the disk's own


@dataclass(frozen=True)
class NodeClass:
    __pydantic_config__ = _STRICT

    nodes: Annotated[str, _Checked(_hostlist_expr)]  # hostlist expression, e.g. gpu[001-128]
    gpus: NonNegInt = 0
    gpu_model: str | None = None
    ib: IBExpect = field(default_factory=IBExpect)
    gpu: GPUThresholds = field(default_factory=GPUThresholds)
    ib_limits: IBThresholds = field(default_factory=IBThresholds)
    node: NodeThresholds = field(default_factory=NodeThresholds)
    nccl: NCCLThresholds = field(default_factory=NCCLThresholds)
    bench: BenchThresholds = field(default_factory=BenchThresholds)
    versions: VersionPins = field(default_factory=VersionPins)
    checkpoint: LocalCheckpoint = field(default_factory=LocalCheckpoint)

    def __post_init__(self) -> None:
        if self.gpus and not self.gpu_model:
            raise ValueError("gpu_model is required when gpus > 0")

    @cached_property
    def hostnames(self) -> frozenset[str]:
        import hostlist

        return frozenset(hostlist.expand_hostlist(self.nodes))


@dataclass(frozen=True)
class Telemetry:
    """The node sampler (bluevela.telemetry.sampler, docs/install.md)."""

    __pydantic_config__ = _STRICT

    interval_s: Annotated[float, Ge(0.1), Le(3600)] = 10.0
    retain_h: Annotated[float, Gt(0)] = 48.0  # oldest segments go first
    max_mb: Annotated[float, Gt(0)] = 256.0  # bound on <state>/samples


def _switch_map(v: dict[str, str]) -> dict[str, str]:
    for name, nodes in v.items():
        if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", name):
            raise ValueError(f"switch name {name!r}: letters, digits, '_', '-', '.'")
        _hostlist_expr(nodes)
    return v


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoint store's job-wide settings (bluevela/ckpt, docs/checkpoints.md)."""

    __pydantic_config__ = _STRICT

    keep_local: Annotated[int, Ge(1), Le(100)] = 2  # node-local steps kept per rank
    drain_every: Annotated[int, Ge(0)] = 0  # every n-th save to shared storage; 0: at the end
    # switch (or rail) name -> hostlist: a node's partner copy goes to another switch
    switches: Annotated[dict[str, str], _Checked(_switch_map)] = field(default_factory=dict)

    def switch_map(self) -> dict[str, str]:
        """node -> switch name."""
        import hostlist

        return {node: sw for sw, nodes in self.switches.items()
                for node in hostlist.expand_hostlist(nodes)}


@dataclass(frozen=True)
class Site:
    __pydantic_config__ = _STRICT

    cluster: Annotated[str, MinLen(1)]
    node_classes: Annotated[dict[str, NodeClass], MinLen(1)]
    partitions: list[str] = field(default_factory=list)
    paths: Paths = field(default_factory=Paths)
    launch: Launch = field(default_factory=Launch)
    health: Health = field(default_factory=Health)
    telemetry: Telemetry = field(default_factory=Telemetry)
    checkpoint: Checkpoints = field(default_factory=Checkpoints)

    def __post_init__(self) -> None:
        if self.launch.default_class is not None and \
                self.launch.default_class not in self.node_classes:
            raise ValueError(f"launch.default_class {self.launch.default_class!r} is not a "
                             f"node class (known: {', '.join(sorted(self.node_classes))})")
        seen: dict[str, str] = {}
        for name, cls in self.node_classes.items():
            for host in cls.hostnames:
                if host in seen:
                    raise ValueError(f"node {host} is in classes {seen[host]} and {name}")
                seen[host] = name

    @property
    def source(self) -> Path | None:
        """Where the site was read from (not part of the file)."""
        return self.__dict__.get("_source")

    @property
    def unknown_keys(self) -> tuple[str, ...]:
        """`PATH:LINE: key: ...` for each key of the file this bv does not know and ignored
        (not part of the file's model; site_file.parse_site)."""
        return self.__dict__.get("_unknown_keys", ())

    def class_name_for(self, node: str | None = None) -> str:
        """The node class of `node` (default: this host), or `$BV_NODE_CLASS` when set."""
        forced = os.environ.get("BV_NODE_CLASS")
        if forced:
            if forced not in self.node_classes:
                raise SiteConfigError(
                    f"BV_NODE_CLASS={forced!r} is not a node class "
                    f"(known: {', '.join(sorted(self.node_classes))})"
                )
            return forced
        import socket

        host = node or socket.gethostname().split(".")[0]
        for name, cls in self.node_classes.items():
            if host in cls.hostnames:
                return name
        raise SiteConfigError(f"node {host!r} is in no node class of {self.source or 'site.yaml'}")

    def node_class(self, node: str | None = None, name: str | None = None) -> NodeClass:
        """The NodeClass by explicit `name`, else for `node` (default: this host)."""
        if name is not None:
            try:
                return self.node_classes[name]
            except KeyError:
                raise SiteConfigError(
                    f"no node class {name!r} (known: {', '.join(sorted(self.node_classes))})"
                ) from None
        return self.node_classes[self.class_name_for(node)]

    def path(self, which: Literal["spool", "archive", "state", "metrics"]) -> Path:
        """A site path, overridden by `$BV_<WHICH>_DIR` when set."""
        env = os.environ.get(f"BV_{which.upper()}_DIR")
        return Path(env) if env else getattr(self.paths, which)


def to_dict(obj: Any) -> Any:
    """A site (or part of one) as plain JSON-able data: what site.yaml would say."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj

