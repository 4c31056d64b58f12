"""The site file: found, read, validated into the model (`bluevela.site_model`; both handed
out by `bluevela.site`), cached.

The file is found from `--site`, then `$BV_SITE`, then `/etc/bluevela/site.yaml`, then
`./site.yaml` only where there is no system file (`choose_site`); root hooks never look in the
current directory (`find_site_path(cwd=False)`). Validation errors come back as `PATH:LINE: message` lines.
pydantic and PyYAML are imported only when a file is actually parsed: a validated site is
cached (JSON, keyed by the file and by the model's own source), so the prolog and `bv submit`
normally rebuild the frozen dataclasses from the cache without either (docs/site-yaml.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bluevela import site_model as model
from bluevela.errors import BluevelaError, SiteConfigError
from bluevela.site_model import Site, _annotation_names, to_dict

logger = logging.getLogger(__name__)

ETC_SITE = Path("/etc/bluevela/site.yaml")
CWD_SITE = Path("site.yaml")
T = TypeVar("T")


def validate(cls: type[T], data: Any) -> T:
    """Validate `data` (parsed YAML) as `cls` with pydantic, imported only here.

    Raises:
        pydantic.ValidationError: as pydantic reports it (parse_site maps it to lines).
    """
    from pydantic import TypeAdapter

    # The annotations resolve in the model's namespace: give pydantic the real constraints.
    vars(model).update(_annotation_names(real=True))
    return TypeAdapter(cls).validate_python(data)


def _build(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild a dataclass from its own `to_dict()` (the cache) without pydantic."""
    import typing

    hints = typing.get_type_hints(cls, localns=_annotation_names(real=False))
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        value, ann = data[f.name], hints[f.name]
        origin, args = typing.get_origin(ann), typing.get_args(ann)
        if dataclasses.is_dataclass(ann):
            value = _build(ann, value)  # type: ignore[arg-type]
        elif origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
            value = {k: _build(args[1], v) for k, v in value.items()}  # type: ignore[arg-type]
        elif ann is Path or Path in args:
            value = None if value is None else Path(value)
        values[f.name] = value
    return cls(**values)


@dataclass(frozen=True)
class SiteChoice:
    """Which site file a command uses, and why (`choose_site`).

    Attributes:
        path: the file, or None when there is none.
        how: where it came from: `--site`, `$BV_SITE`, `system` (/etc/bluevela/site.yaml),
            `cwd` (./site.yaml, only where there is no system file), or `none`.
        ignored: a ./site.yaml passed over because the system file exists.
    """

    path: Path | None
    how: str
    ignored: Path | None = None

    def lines(self) -> list[str]:
        """What a command that depends on the site (bv submit) tells its user on stderr."""
        out = []
        if self.path is None:
            out.append("warning: no site file (--site, $BV_SITE, /etc/bluevela/site.yaml, "
                       "./site.yaml): the job gets none of the site's launch defaults, and no "
                       "checkpoint signal (launch.signal_before_s) unless --signal-before is "
                       "given")
        else:
            shown = {"--site": " (--site)", "$BV_SITE": " ($BV_SITE)",
                     "cwd": " (./site.yaml: there is no /etc/bluevela/site.yaml)"}
            out.append(f"site file: {self.path}{shown.get(self.how, '')}")
        if self.ignored is not None:
            out.append(f"note: {self.ignored} ignored: the site's {ETC_SITE} comes first "
                       f"(--site {self.ignored} to use it)")
        return out


def choose_site(explicit: str | os.PathLike[str] | None = None) -> SiteChoice:
    """The site file of a user's command: `explicit` (--site), `$BV_SITE`, the system file
    /etc/bluevela/site.yaml, and ./site.yaml only where there is no system file.

    The system file comes before the working directory's: a project that happens to carry a
    site.yaml of its own (or another cluster's) must not replace what the site's admin
    configured, on a cluster that has one (issue 35). On a machine without one (a laptop, the
    dev cluster) ./site.yaml still works with no option.
    """
    if explicit:
        return SiteChoice(Path(explicit), "--site")
    env = os.environ.get("BV_SITE")
    if env:
        return SiteChoice(Path(env), "$BV_SITE")
    local = CWD_SITE if CWD_SITE.is_file() else None
    if ETC_SITE.is_file():
        return SiteChoice(ETC_SITE, "system", ignored=local)
    if local is not None:
        return SiteChoice(local, "cwd")
    return SiteChoice(None, "none")


def find_site_path(explicit: str | os.PathLike[str] | None = None, *,
                   cwd: bool = True) -> Path:
    """Resolve the site file: `explicit`, `$BV_SITE`, `/etc/bluevela/site.yaml`, then
    `./site.yaml` where there is no system file (`choose_site`).

    Args:
        explicit: a path given on the command line.
        cwd: look in the current directory. Root entry points (the hooks, EpilogSlurmctld)
            pass False: they run from slurmd's working directory, which others may write, so
            only what root configured counts (`$BV_SITE` from hook.env, else
            /etc/bluevela/site.yaml), and it must be an absolute path.
    """
    if not cwd:
        chosen = os.fspath(explicit) if explicit else os.environ.get("BV_SITE") or str(ETC_SITE)
        if not os.path.isabs(chosen):
            raise SiteConfigError(f"site file {chosen!r} is not an absolute path (a root hook "
                                  "never reads a site file relative to its working directory)")
        return Path(chosen)
    choice = choose_site(explicit)
    if choice.path is None:
        raise SiteConfigError("no site file: pass --site, set BV_SITE, or create "
                              "/etc/bluevela/site.yaml (or ./site.yaml)")
    return choice.path


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


def parse_site(text: str, source: Path, *, strict: bool = False) -> Site:
    """Parse and validate site.yaml text.

    A key this bv's model does not know (a newer bv's key during a rollout, or a typo) is
    dropped and reported (`Site.unknown_keys`, one `PATH:LINE: key: ...` line each, logged as a
    warning by `load_site`) when it is the only kind of problem: a node still on an older bv
    keeps its hooks checking with what it knows instead of failing open on the whole file.
    `strict` (`bv site validate`) makes such a key an error, as every other problem is.

    Raises:
        SiteConfigError: with `PATH:LINE: message` problems.
    """
    root, data = _load_yaml(text, source)
    site, unknown = _validate_site(data, root, source, strict=strict)
    _set_source(site, source)
    _set_unknown(site, unknown)
    return site


def _load_yaml(text: str, source: Path) -> tuple[Any, dict[Any, Any]]:
    """The YAML node tree (for line numbers) and the parsed mapping; SiteConfigError when it
    is not YAML, not a mapping, or not a site description (none of its content quoted)."""
    import yaml

    from bluevela.util.term import printable

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        root = yaml.compose(text, Loader=loader)
        data = yaml.load(text, Loader=loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["?"])[0]
        # The file may be anything (`bv --site /etc/shadow ...`): quote none of its content
        # (a quoted single character, as in "found character '\t'", says nothing).
        problem = printable(re.sub(r"'[^']{4,}'|\"[^\"]{4,}\"", "'...'", problem))
        msg = f"{source}:{line}: YAML syntax error: {problem}"
        raise SiteConfigError(msg, [msg]) from exc
    if not isinstance(data, dict):
        msg = f"{source}:1: the site file must be a mapping"
        raise SiteConfigError(msg, [msg])
    if not {"cluster", "node_classes"} & {k for k in data if isinstance(k, str)}:
        # Some other file that happens to parse as a mapping: say so without echoing its keys.
        msg = (f"{source}:1: not a bluevela site description (no 'cluster:' or "
               "'node_classes:' at the top level)")
        raise SiteConfigError(msg, [msg])
    return root, data


def _validate_site(data: dict[Any, Any], root: Any, source: Path, *,
                   strict: bool) -> tuple[Site, list[str]]:
    """The validated site and its unknown keys' lines (dropped, unless `strict`, when they
    are the only problems); SiteConfigError with every problem's `PATH:LINE: message`."""
    from pydantic import ValidationError

    from bluevela.util.term import printable

    def shown(part: object) -> str:
        """A location part as shown: a key of the file only when it looks like a name."""
        text = str(part)
        return text if re.fullmatch(r"[A-Za-z0-9_./\[\]-]{1,64}", text) else "<key>"

    def describe(err: Any) -> str:
        loc = tuple(err["loc"])
        line = _line_of(root, loc) or 1
        where = ".".join(shown(p) for p in loc) or "(top)"
        message = printable(err["msg"].removeprefix("Value error, "))
        if err["type"] in _UNKNOWN_KEY:
            message = f"{message}: {unknown_key_words()}"
        return f"{source}:{line}: {where}: {message}"

    unknown: list[str] = []
    try:
        site = validate(Site, data)
    except ValidationError as exc:
        errors = exc.errors()
        extra = [e for e in errors if e["type"] in _UNKNOWN_KEY]
        if strict or len(extra) < len(errors) or not _drop_keys(data, extra):
            problems = [describe(err) for err in errors]
            raise SiteConfigError(problems[0], problems) from exc
        extra.sort(key=lambda err: _line_of(root, tuple(err["loc"])) or 1)  # file order
        unknown = [describe(err) for err in extra]
        try:
            site = validate(Site, data)
        except ValidationError as again:
            problems = [describe(err) for err in again.errors()]
            raise SiteConfigError(problems[0], problems) from again
    return site, unknown


# pydantic's error types for a key a dataclass (extra="forbid") does not have.
_UNKNOWN_KEY = frozenset({"unexpected_keyword_argument", "extra_forbidden"})


def unknown_key_words() -> str:
    """What an unknown key's line says after pydantic's own words."""
    from bluevela import __version__

    return (f"a key this bv ({__version__}) does not know: a newer bv's, or a typo "
            "(docs/site-yaml.md, \"Unknown keys\")")


def _drop_keys(data: dict[str, Any], errors: list[Any]) -> bool:
    """Remove each unknown key at its error location from the parsed file; False when one
    cannot be found (then the problems are raised as they are)."""
    for err in errors:
        *parents, last = tuple(err["loc"])
        node: Any = data
        for part in parents:
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        if not isinstance(node, dict) or last not in node:
            return False
        del node[last]
    return True


def _set_unknown(site: Site, lines: list[str]) -> None:
    site.__dict__["_unknown_keys"] = tuple(lines)  # bookkeeping, like the source


def _set_source(site: Site, source: Path) -> None:
    site.__dict__["_source"] = source  # frozen, but not a field: bookkeeping only


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

    # The model's source and this reader's are part of the key: a changed model (or a changed
    # way of rebuilding it) never reads an old cache.
    sources = [os.stat(f).st_mtime_ns for f in (model.__file__, __file__)]
    return {"path": str(path.resolve()), "mtime_ns": st.st_mtime_ns, "size": st.st_size,
            "ino": st.st_ino, "version": __version__, "model_mtime_ns": sources}


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
        site = _build(Site, doc["site"])
        unknown = [str(line) for line in doc.get("unknown_keys", [])]
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    _set_unknown(site, unknown)
    return site


def _write_cache(cache: Path, key: dict[str, Any], site: Site) -> None:
    import json

    from bluevela.util.fs import atomic_write

    try:
        cache.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        body = {"key": key, "site": to_dict(site), "unknown_keys": list(site.unknown_keys)}
        atomic_write(cache, json.dumps(body).encode(), 0o600)
    except (OSError, BluevelaError) as exc:
        logger.debug("site cache not written (%s): %s", cache, exc)


def load_site(explicit: str | os.PathLike[str] | None = None, *, cwd: bool = True,
              strict: bool = False) -> Site:
    """Find (`find_site_path`; `cwd=False` for root entry points), read and validate the
    site file.

    A validated site is cached (JSON, keyed by the file's path, inode, size and mtime, and the
    model's own version) so the prolog and `bv submit` skip YAML parsing and validation when
    the file has not changed.

    Keys this bv does not know are dropped with one warning each (`parse_site`); `strict`
    makes them errors (`bv site validate`).

    Raises:
        SiteConfigError: when missing, unreadable or invalid.
    """
    import zlib  # not hashlib: loading OpenSSL's _hashlib costs every `bv` call ~2 ms

    path = find_site_path(explicit, cwd=cwd)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SiteConfigError(f"{path}: cannot read site file: {exc.strerror}") from exc
    cache_dir = _cache_dir()
    cache = key = None
    if cache_dir is not None:
        key = _cache_key(path, st)
        # the cache file holds its whole key: a name shared by two paths is only a miss
        digest = f"{zlib.crc32(key['path'].encode()):08x}"
        cache = cache_dir / f"site-{digest}.json"
        cached = _read_cache(cache, key)
        if cached is not None:
            _set_source(cached, path)
            return _report_unknown(cached, strict)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SiteConfigError(f"{path}: cannot read site file: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise SiteConfigError(f"{path}:1: not UTF-8 text") from exc
    site = parse_site(text, path)
    if cache is not None and key is not None:
        _write_cache(cache, key, site)
    return _report_unknown(site, strict)


def _report_unknown(site: Site, strict: bool) -> Site:
    """Warn once per unknown key (the hooks' log, a user's stderr), or raise when `strict`."""
    lines = list(site.unknown_keys)
    if lines and strict:
        raise SiteConfigError(lines[0], lines)
    for line in lines:
        logger.warning("%s; ignored", line)
    return site
