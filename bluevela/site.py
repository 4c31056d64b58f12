"""The site model: site.yaml parsed, validated and queried.

The file is found from `--site`, then `$BV_SITE`, then `./site.yaml`, then
`/etc/bluevela/site.yaml`. Validation errors come back as `PATH:LINE: message` lines.
Paths can be overridden per process by `BV_SPOOL_DIR`, `BV_ARCHIVE_DIR`, `BV_STATE_DIR` and
`BV_METRICS_DIR` (the dev cluster gives every node its own), the node class by `BV_NODE_CLASS`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bluevela.errors import BluevelaError, SiteConfigError

logger = logging.getLogger(__name__)

SEARCH_PATHS = (Path("site.yaml"), Path("/etc/bluevela/site.yaml"))
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class Paths(_Model):
    """Where bluevela keeps its files. All absolute."""

    spool: Path = Path("/var/spool/bluevela")
    archive: Path = Path("/var/lib/bluevela/archive")
    state: Path = Path("/var/lib/bluevela/state")
    metrics: Path = Path("/var/lib/node_exporter/textfile")

    @field_validator("spool", "archive", "state", "metrics")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError("must be an absolute path")
        return v


class Launch(_Model):
    """Defaults for `bv submit`."""

    rdzv_port: int = Field(29500, ge=1024, le=65535)
    torchrun: list[str] = Field(default_factory=lambda: ["torchrun"], min_length=1)
    max_restarts: int = Field(0, ge=0, le=100)
    requeue: bool = True
    output: str = "bv-%j.out"
    env: dict[str, str] = Field(default_factory=dict)
    submit_retry_s: float = Field(120.0, ge=0, description="how long to retry an unreachable slurmctld")
    default_partition: str | None = None

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_NAME.match(key):
                raise ValueError(f"invalid environment variable name {key!r}")
            if "\n" in value or "\0" in value:
                raise ValueError(f"value of {key} contains a newline or NUL")
        return v


class Tier(_Model):
    checks: list[str]
    cap_s: float = Field(gt=0, description="hard cap on the whole run")
    check_timeout_s: float = Field(gt=0, description="each check's own timeout")


def _default_tiers() -> dict[str, Tier]:
    return {
        "quick": Tier(checks=["gpu", "ib", "node"], cap_s=5.0, check_timeout_s=3.0),
        "full": Tier(checks=["gpu", "ib", "node", "nccl"], cap_s=180.0, check_timeout_s=120.0),
    }


class Health(_Model):
    """How the hooks run the checks."""

    tiers: dict[str, Tier] = Field(default_factory=_default_tiers)
    nccl_freshness_h: float = Field(6.0, ge=0, description="prolog reruns nccl when older; 0 = never")
    retries: int = Field(3, ge=1, le=10, description="noisy measurements: pass if any try passes")
    drain_timeout_s: float = Field(5.0, gt=0)
    fleet_breaker_pct: float = Field(15.0, ge=0, le=100)
    drain_prefix: str = "bv:"

    @model_validator(mode="after")
    def _tiers_present(self) -> Health:
        for name in ("quick", "full"):
            if name not in self.tiers:
                raise ValueError(f"health.tiers needs a '{name}' tier")
        return self


class IBExpect(_Model):
    """The InfiniBand ports a node class must have."""

    ports: list[str] = Field(default_factory=list, description="'<hca>/<port>', e.g. mlx5_0/1")
    rate_gbps: float = Field(0, ge=0)
    link_layer: Literal["InfiniBand", "Ethernet"] = "InfiniBand"

    @field_validator("ports")
    @classmethod
    def _port_form(cls, v: list[str]) -> list[str]:
        for p in v:
            if not re.match(r"^[A-Za-z0-9_.-]+/[0-9]+$", p):
                raise ValueError(f"port {p!r} is not '<hca>/<port>'")
        return v


class GPUThresholds(_Model):
    max_temp_c: float = 87.0
    max_uncorrected_ecc_volatile: int = 0
    max_uncorrected_ecc_aggregate: int = 0
    max_retired_pages: int = 60  # NVIDIA's RMA criterion
    allow_leftover_processes: bool = False
    require_persistence_mode: bool = True


class IBThresholds(_Model):
    """Absolute ceilings for error counters, and for their increase since the last reading."""

    max_counters: dict[str, int] = Field(
        default_factory=lambda: {
            "symbol_error": 1000,
            "link_downed": 10,
            "link_error_recovery": 100,
            "port_rcv_errors": 1000,
            "local_link_integrity_errors": 10,
            "excessive_buffer_overrun_errors": 10,
        }
    )
    max_increase: dict[str, int] = Field(
        default_factory=lambda: {
            "symbol_error": 10,
            "link_downed": 0,
            "link_error_recovery": 0,
            "port_rcv_errors": 10,
        }
    )


class NodeThresholds(_Model):
    min_mem_available_gib: float = Field(1.0, ge=0)
    min_free_gib: dict[str, float] = Field(default_factory=lambda: {"/tmp": 1.0})
    required_paths: list[str] = Field(default_factory=list)
    required_mounts: list[str] = Field(default_factory=list)
    required_devices: list[str] = Field(default_factory=list)


class NCCLThresholds(_Model):
    """All_reduce bus bandwidth inside the node at a stated size (nccl-tests definition)."""

    size_bytes: int = Field(1 << 30, gt=0)
    iters: int = Field(20, ge=1)
    warmup: int = Field(5, ge=0)
    min_busbw_gbs: float = Field(0.0, ge=0)
    procs: int | None = Field(None, ge=1, description="ranks on a CPU node (default 2)")


class BenchThresholds(_Model):
    """Absolute acceptance floors for the nightly benchmarks (units in the names)."""

    gemm_tflops: float = 0.0
    hbm_gbs: float = 0.0
    h2d_gbs: float = 0.0
    d2h_gbs: float = 0.0
    allreduce_busbw_gbs: float = 0.0
    pair_busbw_gbs: float = 0.0
    mpi_bw_gbs: float = 0.0
    mpi_lat_us_max: float = 0.0  # 0 = no ceiling
    regression_nights: int = Field(7, ge=1)
    regression_tolerance_pct: float = Field(10.0, ge=0, le=100)
    # The message sizes the floors above apply to (the largest size of each sweep);
    # 0 = the measurement's default for the node's backend (CUDA or CPU).
    allreduce_size_bytes: int = Field(0, ge=0)
    pair_size_bytes: int = Field(0, ge=0)
    mpi_size_bytes: int = Field(0, ge=0)


class NodeClass(_Model):
    nodes: str = Field(description="hostlist expression, e.g. gpu[001-128]")
    gpus: int = Field(0, ge=0)
    gpu_model: str | None = None
    ib: IBExpect = Field(default_factory=IBExpect)
    gpu: GPUThresholds = Field(default_factory=GPUThresholds)
    ib_limits: IBThresholds = Field(default_factory=IBThresholds)
    node: NodeThresholds = Field(default_factory=NodeThresholds)
    nccl: NCCLThresholds = Field(default_factory=NCCLThresholds)
    bench: BenchThresholds = Field(default_factory=BenchThresholds)

    @field_validator("nodes")
    @classmethod
    def _hostlist(cls, v: str) -> str:
        import hostlist

        try:
            hostlist.expand_hostlist(v)
        except hostlist.BadHostlist as exc:
            raise ValueError(f"bad hostlist {v!r}: {exc}") from exc
        return v

    @model_validator(mode="after")
    def _gpu_model(self) -> NodeClass:
        if self.gpus and not self.gpu_model:
            raise ValueError("gpu_model is required when gpus > 0")
        return self

    @cached_property
    def hostnames(self) -> frozenset[str]:
        import hostlist

        return frozenset(hostlist.expand_hostlist(self.nodes))


class Site(_Model):
    model_config = ConfigDict(
        extra="forbid", frozen=True, defer_build=True, ignored_types=(cached_property,)
    )

    cluster: str = Field(min_length=1)
    partitions: list[str] = Field(default_factory=list)
    paths: Paths = Field(default_factory=Paths)
    launch: Launch = Field(default_factory=Launch)
    health: Health = Field(default_factory=Health)
    node_classes: dict[str, NodeClass] = Field(min_length=1)

    # Not part of the file: where it was read from.
    source: Path | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _checks(self) -> Site:
        seen: dict[str, str] = {}
        for name, cls in self.node_classes.items():
            for host in cls.hostnames:
                if host in seen:
                    raise ValueError(f"node {host} is in classes {seen[host]} and {name}")
                seen[host] = name
        return self

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


def find_site_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the site file: `explicit`, `$BV_SITE`, `./site.yaml`, `/etc/bluevela/site.yaml`."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("BV_SITE")
    if env:
        return Path(env)
    for candidate in SEARCH_PATHS:
        if candidate.is_file():
            return candidate
    raise SiteConfigError(
        "no site file: pass --site, set BV_SITE, or create ./site.yaml or /etc/bluevela/site.yaml"
    )


def _line_of(root: Any, loc: tuple[int | str, ...]) -> int | None:
    """1-based line of the YAML node at pydantic error location `loc` (deepest node found)."""
    import yaml

    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == key:
                    nxt = v
                    line = k.start_mark.line + 1
                    break
            if nxt is None:
                break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            break
    return line


def parse_site(text: str, source: Path) -> Site:
    """Parse and validate site.yaml text.

    Raises:
        SiteConfigError: with `PATH:LINE: message` problems.
    """
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        root = yaml.compose(text, Loader=loader)
        data = yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        msg = f"{source}:{line}: YAML syntax error: {problem}"
        raise SiteConfigError(msg, [msg]) from exc
    if not isinstance(data, dict):
        msg = f"{source}:1: the site file must be a mapping"
        raise SiteConfigError(msg, [msg])
    try:
        return Site.model_validate({**data, "source": source})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            line = _line_of(root, loc) or 1
            where = ".".join(str(p) for p in loc) or "(top)"
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"{source}:{line}: {where}: {message}")
        raise SiteConfigError(problems[0], problems) from exc


def _cache_dir() -> Path | None:
    """Where validated sites are cached: `$BV_CACHE_DIR`, root: /var/cache/bluevela,
    others: ~/.cache/bluevela. `BV_CACHE_DIR=off` disables the cache."""
    env = os.environ.get("BV_CACHE_DIR")
    if env:
        return None if env == "off" else Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/bluevela")
    home = os.environ.get("HOME")
    return Path(home) / ".cache" / "bluevela" if home else None


def _cache_key(path: Path, st: os.stat_result) -> dict[str, Any]:
    from bluevela import __version__

    # The model's own source is part of the key: a changed model never reads an old cache.
    model = os.stat(__file__)
    return {"path": str(path.resolve()), "mtime_ns": st.st_mtime_ns, "size": st.st_size,
            "ino": st.st_ino, "version": __version__, "model_mtime_ns": model.st_mtime_ns}


def _construct(cls: type[BaseModel], data: dict[str, Any]) -> Any:
    """Rebuild a validated model from its own `model_dump(mode="json")` without validating.

    Only for data this module validated and cached itself; covers the field shapes the site
    model uses (nested models, dicts of models, paths, primitives).
    """
    import typing

    values: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        if name not in data:
            continue
        value, ann = data[name], field.annotation
        origin, args = typing.get_origin(ann), typing.get_args(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            value = _construct(ann, value)
        elif origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(
            args[1], BaseModel
        ):
            value = {k: _construct(args[1], v) for k, v in value.items()}
        elif (ann is Path or Path in args) and value is not None:
            value = Path(value)
        values[name] = value
    return cls.model_construct(_fields_set=set(values), **values)


def _read_cache(cache: Path, key: dict[str, Any]) -> Site | None:
    """The cached site when the cache file is ours, private, and its key matches."""
    import json
    import stat as stat_mod

    from bluevela.util.fs import read_no_follow

    try:
        st = os.lstat(cache)
        if (not stat_mod.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o022):
            return None
        doc = json.loads(read_no_follow(cache, limit=4 << 20))
    except (OSError, ValueError, BluevelaError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != key:
        return None
    try:
        site: Site = _construct(Site, doc["site"])
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    return site


def _write_cache(cache: Path, key: dict[str, Any], site: Site) -> None:
    import json

    from bluevela.util.fs import atomic_write

    try:
        cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        body = {"key": key, "site": site.model_dump(mode="json", exclude={"source"})}
        atomic_write(cache, json.dumps(body).encode(), 0o600)
    except (OSError, BluevelaError) as exc:
        logger.debug("site cache not written (%s): %s", cache, exc)


def load_site(explicit: str | os.PathLike[str] | None = None) -> Site:
    """Find, read and validate the site file.

    A validated site is cached (JSON, keyed by the file's path, inode, size and mtime, and the
    model's own version) so the prolog and `bv submit` skip YAML parsing and validation when
    the file has not changed.

    Raises:
        SiteConfigError: when missing, unreadable or invalid.
    """
    import hashlib

    path = find_site_path(explicit)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SiteConfigError(f"{path}: cannot read site file: {exc.strerror}") from exc
    cache_dir = _cache_dir()
    cache = key = None
    if cache_dir is not None:
        key = _cache_key(path, st)
        digest = hashlib.sha256(key["path"].encode()).hexdigest()[:16]
        cache = cache_dir / f"site-{digest}.json"
        cached = _read_cache(cache, key)
        if cached is not None:
            object.__setattr__(cached, "source", path)
            return cached
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SiteConfigError(f"{path}: cannot read site file: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise SiteConfigError(f"{path}:1: not UTF-8 text") from exc
    site = parse_site(text, path)
    if cache is not None and key is not None:
        _write_cache(cache, key, site)
    return site
