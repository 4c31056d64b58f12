"""The one place a check is registered: `@check(name, probe=...)` on its evaluator.

A check is a probe (gathers facts once, through the roots in `ProbeContext`) and a pure
evaluator `(facts, node_class) -> CheckResult`. Registering a name twice is an error.

A leaf: it imports nothing of bluevela but `errors`, so both the site model (which validates
tier check names against it) and the checks (which register into it) may import it without
a loop. The built-in checks are loaded by module name (`BUILTIN`), as a plugin would be.
"""

from __future__ import annotations

import importlib
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


_REGISTRY: dict[str, Check] = {}


def register(item: Check) -> Check:
    """Add `item` to the registry.

    Raises:
        HealthError: a check of that name is already registered.
    """
    if item.name in _REGISTRY:
        raise HealthError(f"health check {item.name!r} is registered twice")
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


#: The packages whose import registers the built-in checks.
BUILTIN = ("bluevela.health.checks",)


def load_builtin() -> None:
    """Import the built-in checks (gpu, ib, node, nccl, ...); cheap, none imports torch or
    pynvml."""
    for name in BUILTIN:
        importlib.import_module(name)


def all_checks() -> dict[str, Check]:
    load_builtin()
    return dict(_REGISTRY)


def get_check(name: str) -> Check:
    """The registered check `name`.

    Raises:
        HealthError: no such check (the message lists the known ones).
    """
    load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise HealthError(
            f"no health check {name!r} (known: {', '.join(sorted(_REGISTRY))})"
        ) from None
