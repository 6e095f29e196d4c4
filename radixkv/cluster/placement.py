"""CPU reservations for a fleet: fit the replicas to the cluster's CPUs, or say why they cannot fit.

Ray schedules an actor only on a node where its ``num_cpus`` reservation fits, and Ray Serve
retries an unschedulable replica forever (a warning every 30 s, the application never
RUNNING). Four replicas reserving Ray's customary 1 CPU each plus the ingress's 0.1 need 4.1
CPUs, so on a 2-core machine such a fleet never answers. ``radixkv serve-ray`` therefore plans
the reservations before it deploys (:func:`plan_cpus`):

* on a cluster it starts itself, the CPUs are known and fixed: replicas without an explicit
  ``--replica-cpus`` share what the ingress leaves (at most 1 CPU each), and an explicit
  reservation that cannot fit fails at once, naming the numbers and the flag to change;
* on a cluster it joins (``--address``), an autoscaler may still add nodes, so a fleet larger
  than the CPUs free right now is a warning, and the start-up timeout is the backstop.

A reservation is bookkeeping for Ray's scheduler, not a limit on the process: a replica runs
``--torch-threads`` intra-op threads whatever it reserves. Pure arithmetic, no Ray import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Ray's usual reservation for one actor, and the most a fitted replica takes: a replica runs
# one torch intra-op thread by default, so reserving more than a core buys it nothing.
DEFAULT_REPLICA_CPUS = 1.0
# Fitted reservations are rounded down to this step, so the log line reads "0.47", not
# "0.475000001", and the sum never exceeds the CPUs by a rounding error. (Ray accepts
# multiples of 0.0001.)
CPU_STEP = 0.01
# The flags a user changes; named in the messages.
REPLICA_CPUS_FLAG = "--replica-cpus"
NUM_CPUS_FLAG = "--num-cpus"


class FleetDoesNotFit(ValueError):
    """The replicas' CPU reservations cannot all be scheduled on this cluster (the message says
    how many CPUs are asked for, how many there are, and which flag to change)."""


@dataclass(frozen=True, kw_only=True)
class CpuPlan:
    """The reservations a fleet will ask Ray for.

    Attributes:
        replicas: engine replicas.
        replica_cpus: CPUs reserved per engine replica.
        ingress_replicas / ingress_cpus: ingress replicas and the CPUs each reserves.
        available_cpus: CPUs the cluster had free when planned.
        fitted: ``replica_cpus`` was chosen here to fit the cluster.
        given: ``replica_cpus`` was given by the user (neither fitted nor the default).
        local: the cluster was started for this fleet (its CPUs cannot grow).
    """

    replicas: int
    replica_cpus: float
    ingress_replicas: int
    ingress_cpus: float
    available_cpus: float
    fitted: bool
    given: bool
    local: bool

    @property
    def total_cpus(self) -> float:
        """CPUs the whole fleet reserves (replicas and ingress)."""
        return self.replicas * self.replica_cpus + self.ingress_replicas * self.ingress_cpus

    @property
    def fits(self) -> bool:
        """Whether every reservation fits in the CPUs free when planned."""
        return self.total_cpus <= self.available_cpus + 1e-9

    def describe(self) -> str:
        """One line for the log: what was reserved, out of how much, and why."""
        how = "the default"
        if self.fitted:
            how = "fitted to the cluster"
        elif self.given:
            how = f"set by {REPLICA_CPUS_FLAG}"
        line = (
            f"{self.replicas} replicas x {self.replica_cpus:g} CPU ({how}) + "
            f"{_ingress(self)} = {self.total_cpus:g} of {self.available_cpus:g} CPUs"
            + ("" if self.local else " free")
        )
        if self.fitted and self.replica_cpus < DEFAULT_REPLICA_CPUS:
            line += (
                f"; the replicas share the CPUs (set {REPLICA_CPUS_FLAG} to choose, "
                f"{NUM_CPUS_FLAG} to give Ray more)"
            )
        if not self.fits:
            line += (
                "; not enough CPUs free now: waiting for the cluster to grow (or lower "
                f"{REPLICA_CPUS_FLAG} or --replicas)"
            )
        return line


def _ingress(plan: CpuPlan) -> str:
    n = plan.ingress_replicas
    return f"{plan.ingress_cpus:g} CPU for the ingress" + (f" x {n}" if n > 1 else "")


def _floor_step(x: float) -> float:
    return math.floor(x / CPU_STEP + 1e-9) * CPU_STEP


def largest_fitting_replica_cpus(
    *, replicas: int, available_cpus: float, ingress_cpus: float, ingress_replicas: int = 1
) -> float:
    """The largest reservation (a multiple of CPU_STEP, at most DEFAULT_REPLICA_CPUS) with which
    ``replicas`` replicas and the ingress fit in ``available_cpus``; 0.0 when none does."""
    left = available_cpus - ingress_replicas * ingress_cpus
    if left <= 0:
        return 0.0
    return round(min(DEFAULT_REPLICA_CPUS, _floor_step(left / replicas)), 4)


def plan_cpus(
    *,
    replicas: int,
    available_cpus: float,
    replica_cpus: float | None = None,
    ingress_cpus: float = 0.1,
    ingress_replicas: int = 1,
    local: bool = True,
) -> CpuPlan:
    """Plan the CPU reservations of ``replicas`` engine replicas and the ingress.

    ``replica_cpus=None`` means "choose": on a ``local`` cluster the largest reservation that
    fits (:func:`largest_fitting_replica_cpus`), elsewhere DEFAULT_REPLICA_CPUS. A given value
    is kept. Raises FleetDoesNotFit when, on a local cluster, the fleet cannot fit: a given
    reservation too large, or so many replicas that not even CPU_STEP each is left. On a
    joined cluster it never raises: check :attr:`CpuPlan.fits` and warn.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if replica_cpus is not None and not replica_cpus >= 0:
        raise ValueError(f"{REPLICA_CPUS_FLAG} must be >= 0, got {replica_cpus}")
    given = replica_cpus is not None
    fitted = not given and local
    best = largest_fitting_replica_cpus(
        replicas=replicas,
        available_cpus=available_cpus,
        ingress_cpus=ingress_cpus,
        ingress_replicas=ingress_replicas,
    )
    if replica_cpus is None:
        replica_cpus = best if local else DEFAULT_REPLICA_CPUS
    plan = CpuPlan(
        replicas=replicas,
        replica_cpus=replica_cpus,
        ingress_replicas=ingress_replicas,
        ingress_cpus=ingress_cpus,
        available_cpus=available_cpus,
        fitted=fitted,
        given=given,
        local=local,
    )
    if local and (not plan.fits or (fitted and best < CPU_STEP)):
        raise FleetDoesNotFit(_does_not_fit(plan, best))
    return plan


def _does_not_fit(plan: CpuPlan, best: float) -> str:
    need = (
        f"{plan.replicas} replicas x {plan.replica_cpus:g} CPU ({REPLICA_CPUS_FLAG}) + "
        f"{_ingress(plan)} = {plan.total_cpus:g} CPUs"
    )
    if plan.fitted:  # even the smallest step per replica is too much
        need = f"{plan.replicas} replicas x at least {CPU_STEP:g} CPU + {_ingress(plan)}"
    fixes = []
    if best >= CPU_STEP and plan.given:
        fixes.append(
            f"lower {REPLICA_CPUS_FLAG} to {best:g} or less (or leave it out to fit the "
            "replicas automatically)"
        )
    fixes += ["run fewer --replicas", f"start Ray with more CPUs ({NUM_CPUS_FLAG})"]
    return (
        f"the fleet does not fit: {need}, but the local Ray cluster has "
        f"{plan.available_cpus:g} CPUs, so Ray would never schedule every replica. To fix: "
        + "; or ".join(fixes)
    )
