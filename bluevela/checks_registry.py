"""The one place a check is registered: `@check(name, probe=...)` on its evaluator.

A check is a probe (gathers facts once, through the roots in `ProbeContext`) and a pure
evaluator `(facts, node_class) -> CheckResult`. Registering a name twice is an error.

A leaf: it imports nothing of bluevela but `errors`, so both the site model (which validates
tier check names against it) and the checks (which register into it) may import it without
a loop. The built-in checks are named in a static table (`BUILTIN_CHECKS`): the site model
reads the names from it and imports no check, and `register` refuses a check of the built-in
package whose name (and module) the table does not hold. Importing `bluevela.health.checks`
registers the built-in checks; its `all_checks`/`get_check` look them up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from bluevela.errors import HealthError

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.health.result import CheckResult
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)

Facts = TypeVar("Facts")
Evaluator = Callable[[Any, "NodeClass"], "CheckResult"]


@dataclass(frozen=True)
class Check:
    """A registered check.

    Attributes:
        name: unique name, used in site.yaml tiers and drain reasons.
        probe: gathers facts (may be slow, may hang: the runner bounds it).
        evaluate: pure function of the facts and the node class's thresholds.
        noisy: a measurement that can be noisy (bandwidth): retried `health.retries` times,
            passing if any try passes.
        doc: one line for `bv health run --help`-style listings.
        on_timeout: the verdict when the runner kills the check at its timeout
            `(seconds, node_class) -> CheckResult`; None: UNKNOWN (could not run).
    """

    name: str
    probe: Callable[[ProbeContext], Any]
    evaluate: Evaluator
    noisy: bool = False
    doc: str = ""
    on_timeout: Callable[[float, NodeClass], CheckResult] | None = None

    def run_once(self, ctx: ProbeContext) -> CheckResult:
        """Probe, then evaluate against the context's node class."""
        return self.evaluate(self.probe(ctx), ctx.node_class)


#: The package whose modules define the built-in checks.
BUILTIN_PACKAGE = "bluevela.health.checks"

#: Every built-in check's name and the module that registers it. A site's tiers are
#: validated against these names without importing a check; a check in `BUILTIN_PACKAGE`
#: registered under a name (or from a module) not listed here is refused, and
#: tests/health/test_health_framework.py fails on a name listed here that no module registers.
BUILTIN_CHECKS: dict[str, str] = {
    "dcgm": f"{BUILTIN_PACKAGE}.dcgm",
    "gpu": f"{BUILTIN_PACKAGE}.gpu",
    "ib": f"{BUILTIN_PACKAGE}.ib",
    "nccl": f"{BUILTIN_PACKAGE}.nccl",
    "node": f"{BUILTIN_PACKAGE}.node",
    "versions": f"{BUILTIN_PACKAGE}.versions",
}

_REGISTRY: dict[str, Check] = {}


def register(item: Check) -> Check:
    """Add `item` to the registry.

    Raises:
        HealthError: a check of that name is already registered, or a check defined in
            `BUILTIN_PACKAGE` is not in `BUILTIN_CHECKS` under its name and module.
    """
    if item.name in _REGISTRY:
        raise HealthError(f"health check {item.name!r} is registered twice")
    module = getattr(item.evaluate, "__module__", None) or ""
    if module.startswith(f"{BUILTIN_PACKAGE}.") and BUILTIN_CHECKS.get(item.name) != module:
        raise HealthError(f"built-in health check {item.name!r} ({module}) is not in "
                          "checks_registry.BUILTIN_CHECKS under that name and module")
    _REGISTRY[item.name] = item
    return item


def unregister(name: str) -> None:
    """Remove a check (tests register throw-away checks)."""
    _REGISTRY.pop(name, None)


def check(
    name: str, *, probe: Callable[[ProbeContext], Any], noisy: bool = False,
    on_timeout: Callable[[float, NodeClass], CheckResult] | None = None,
) -> Callable[[Callable[[Facts, NodeClass], CheckResult]], Callable[[Facts, NodeClass], CheckResult]]:
    """Decorator for an evaluator: registers `Check(name, probe, evaluator)`.

    Example:
        @check("ib", probe=probe_ib)
        def evaluate_ib(facts: IBFacts, cls: NodeClass) -> CheckResult: ...
    """

    def deco(
        evaluate: Callable[[Facts, NodeClass], CheckResult],
    ) -> Callable[[Facts, NodeClass], CheckResult]:
        doc = (evaluate.__doc__ or "").strip().splitlines()
        register(Check(name, probe, evaluate, noisy, doc[0] if doc else "", on_timeout))
        return evaluate

    return deco


def known_names() -> list[str]:
    """The names a site's tiers may use, sorted: the built-in checks (from the table, none
    imported) and any other check registered so far."""
    return sorted(set(BUILTIN_CHECKS) | set(_REGISTRY))


def registered() -> dict[str, Check]:
    """The checks registered so far (the built-in ones once `bluevela.health.checks` is
    imported)."""
    return dict(_REGISTRY)


def lookup(name: str) -> Check:
    """The registered check `name` (imports nothing: see `bluevela.health.checks.get_check`).

    Raises:
        HealthError: no such check (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise HealthError(
            f"no health check {name!r} (known: {', '.join(sorted(_REGISTRY))})"
        ) from None
