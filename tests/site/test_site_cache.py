"""The validated-site cache: same site as a fresh validation, invalidated by any change,
ignored when not private to the user."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bluevela.errors import SiteConfigError
from bluevela.site import load_site, to_dict
from tests.conftest import REPO


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("BV_CACHE_DIR", str(d))
    return d


def test_cached_site_equals_fresh(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_site(REPO / "site.yaml")
    files = list(cache.glob("site-*.json"))
    assert len(files) == 1 and (files[0].stat().st_mode & 0o777) == 0o600
    cached = load_site(REPO / "site.yaml")
    monkeypatch.setenv("BV_CACHE_DIR", "off")
    fresh = load_site(REPO / "site.yaml")
    assert to_dict(cached) == to_dict(fresh) == to_dict(first)
    assert cached == fresh
    assert cached.node_class("gpu007").ib.ports == fresh.node_class("gpu007").ib.ports
    assert cached.paths.spool == Path("/var/spool/bluevela") and cached.source == REPO / "site.yaml"


def test_edit_invalidates_cache(cache: Path, tmp_path: Path) -> None:
    site = tmp_path / "site.yaml"
    text = (REPO / "site.yaml").read_text()
    site.write_text(text)
    assert load_site(site).cluster == "bluevela-dev"
    site.write_text(text.replace("cluster: bluevela-dev", "cluster: renamed"))
    assert load_site(site).cluster == "renamed"
    site.write_text(text.replace("max_restarts: 0", "max_restarts: -1"))
    with pytest.raises(SiteConfigError, match="max_restarts"):
        load_site(site)


def test_tampered_or_shared_cache_is_ignored(cache: Path, tmp_path: Path) -> None:
    site = tmp_path / "site.yaml"
    site.write_text((REPO / "site.yaml").read_text())
    load_site(site)
    (entry,) = cache.glob("site-*.json")
    doc = json.loads(entry.read_text())
    doc["site"]["cluster"] = "forged"
    entry.write_text(json.dumps(doc))
    os.chmod(entry, 0o666)  # writable by others: never trusted
    assert load_site(site).cluster == "bluevela-dev"
