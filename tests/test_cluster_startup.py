"""``radixkv serve-ray`` start-up without Ray: fitting replicas to the CPUs, failing at once when
they cannot fit, and waiting for the application with a deadline.

(The same start-up with a real Ray, as the README shows it: tests/test_cluster_serve_ray.py.)
"""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.cluster.cli import main
from radixkv.cluster.placement import (
    CPU_STEP,
    FleetDoesNotFit,
    largest_fitting_replica_cpus,
    plan_cpus,
)
from radixkv.cluster.readiness import (
    AppState,
    DeploymentNotReady,
    DeploymentState,
    app_state,
    check_reachable,
    wait_until_running,
)

# --- fitting ---------------------------------------------------------------------------------


def test_issue_case_two_replicas_on_two_cores_share_them() -> None:
    """The reported hang: 2 x 1 CPU + 0.1 for the ingress on 2 CPUs. Now they share."""
    plan = plan_cpus(replicas=2, available_cpus=2.0)
    assert plan.fitted and plan.fits
    assert plan.replica_cpus == pytest.approx(0.95)
    assert plan.total_cpus <= 2.0
    line = plan.describe()
    assert "2 replicas x 0.95 CPU (fitted to the cluster)" in line
    assert "0.1 CPU for the ingress" in line and "of 2 CPUs" in line
    assert "--replica-cpus" in line  # says how to choose instead


def test_readme_example_four_replicas_on_two_cores() -> None:
    plan = plan_cpus(replicas=4, available_cpus=2.0)
    assert plan.replica_cpus == pytest.approx(0.47)  # (2 - 0.1) / 4 = 0.475, rounded down
    assert plan.total_cpus == pytest.approx(1.98)


def test_a_fitted_replica_never_reserves_more_than_one_cpu() -> None:
    plan = plan_cpus(replicas=2, available_cpus=16.0)
    assert plan.replica_cpus == 1.0 and plan.fits
    assert "share" not in plan.describe()  # nothing is shared: no advice needed


def test_an_explicit_reservation_that_fits_is_kept() -> None:
    plan = plan_cpus(replicas=3, available_cpus=2.0, replica_cpus=0.5)
    assert plan.replica_cpus == 0.5 and not plan.fitted and plan.fits
    assert "(set by --replica-cpus)" in plan.describe()
    assert plan_cpus(replicas=8, available_cpus=1.0, replica_cpus=0.0).fits  # no reservation


def test_an_explicit_reservation_too_large_fails_naming_numbers_and_flags() -> None:
    with pytest.raises(FleetDoesNotFit) as e:
        plan_cpus(replicas=4, available_cpus=2.0, replica_cpus=1.0)
    msg = str(e.value)
    assert "4 replicas x 1 CPU (--replica-cpus)" in msg  # replicas, CPUs per replica, the flag
    assert "= 4.1 CPUs" in msg and "has 2 CPUs" in msg  # what is needed, what there is
    assert "lower --replica-cpus to 0.47 or less" in msg  # the value that would fit
    assert "--replicas" in msg and "--num-cpus" in msg


def test_too_many_replicas_to_fit_at_all() -> None:
    with pytest.raises(FleetDoesNotFit) as e:
        plan_cpus(replicas=500, available_cpus=2.0)
    msg = str(e.value)
    assert "500 replicas" in msg and "has 2 CPUs" in msg and "--replicas" in msg
    assert "lower --replica-cpus" not in msg  # no reservation would fit: do not suggest one
    with pytest.raises(FleetDoesNotFit):  # the ingress alone takes every CPU
        plan_cpus(replicas=1, available_cpus=1.0, ingress_cpus=1.0)


def test_a_joined_cluster_only_warns() -> None:
    """An autoscaler may add nodes to a joined cluster: too few CPUs now is not an error."""
    plan = plan_cpus(replicas=4, available_cpus=2.0, local=False)
    assert plan.replica_cpus == 1.0 and not plan.fitted  # Ray's usual reservation, not fitted
    assert not plan.fits
    assert "4 replicas x 1 CPU (the default)" in plan.describe()
    assert "= 4.1 of 2 CPUs free" in plan.describe()
    assert "waiting for the cluster to grow" in plan.describe()
    assert plan_cpus(replicas=1, available_cpus=2.0, local=False).fits


def test_bad_inputs_are_errors() -> None:
    with pytest.raises(ValueError, match="replicas"):
        plan_cpus(replicas=0, available_cpus=2.0)
    with pytest.raises(ValueError, match="--replica-cpus"):
        plan_cpus(replicas=1, available_cpus=2.0, replica_cpus=-1.0)


@given(
    replicas=st.integers(1, 64),
    cpus=st.integers(1, 128),
    ingress_replicas=st.integers(1, 3),
    ingress_cpus=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
)
def test_a_fitted_fleet_always_fits_and_uses_the_cpus(
    replicas: int, cpus: int, ingress_replicas: int, ingress_cpus: float
) -> None:
    best = largest_fitting_replica_cpus(
        replicas=replicas,
        available_cpus=float(cpus),
        ingress_cpus=ingress_cpus,
        ingress_replicas=ingress_replicas,
    )
    try:
        plan = plan_cpus(
            replicas=replicas,
            available_cpus=float(cpus),
            ingress_cpus=ingress_cpus,
            ingress_replicas=ingress_replicas,
        )
    except FleetDoesNotFit:
        assert best < CPU_STEP
        return
    assert plan.fits and plan.replica_cpus == best
    assert CPU_STEP <= plan.replica_cpus <= 1.0
    # maximal: one more step per replica would not fit (unless already at one CPU each)
    more = plan.replicas * (plan.replica_cpus + CPU_STEP) + ingress_replicas * ingress_cpus
    assert plan.replica_cpus == 1.0 or more > cpus
    # and the explicit reservation Ray would get is accepted as given
    again = plan_cpus(
        replicas=replicas,
        available_cpus=float(cpus),
        replica_cpus=plan.replica_cpus,
        ingress_cpus=ingress_cpus,
        ingress_replicas=ingress_replicas,
    )
    assert again.fits and again.total_cpus == pytest.approx(plan.total_cpus)


# --- the command line fails before starting Ray ----------------------------------------------


def test_serve_ray_fails_at_once_when_the_fleet_cannot_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 1 with the reason, before Ray is started (a Ray start takes seconds; this does not
    start one: ray is not initialized afterwards)."""
    argv = ["--replicas", "4", "--replica-cpus", "1", "--num-cpus", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "radixkv serve-ray: error: the fleet does not fit" in err
    assert "4 replicas x 1 CPU (--replica-cpus)" in err and "has 2 CPUs" in err
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-cpus", "0"],
        ["--replica-cpus", "-0.5"],
        ["--ready-timeout", "-1"],
        ["--address", "auto", "--num-cpus", "4"],
    ],
)
def test_bad_startup_flags_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and argv[-2] in err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_an_address_nobody_answers_fails_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """ray.init retries an unreachable address for many minutes; serve-ray says so instead."""
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(DeploymentNotReady, match=f"no Ray cluster answers at {address}"):
        check_reachable(address, timeout_s=5)
    assert main(["--address", address]) == 1
    err = capsys.readouterr().err
    assert f"radixkv serve-ray: error: no Ray cluster answers at {address} (--address)" in err
    import ray

    assert not ray.is_initialized()


def test_reachable_and_unprobed_addresses_pass() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}", timeout_s=5)
    for address in ("auto", "ray://127.0.0.1:1", "local"):  # left to Ray
        check_reachable(address, timeout_s=5)


# --- waiting for the application -------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _states(*states: AppState | None) -> object:
    it = iter(states)
    last: list[AppState | None] = [None]

    def get() -> AppState | None:
        last[0] = next(it, last[0])  # the last state repeats
        return last[0]

    return get


UNSCHEDULABLE = (
    "Deployment 'RadixKVIngress' in application 'radixkv' has 1 replicas that have taken more "
    "than 30s to be scheduled. Resources required for each replica: {'CPU': 0.1}, total "
    "resources available: {'CPU': 0.0}."
)


def _deploying(message: str = "") -> AppState:
    return AppState(
        status="DEPLOYING",
        deployments={
            "RadixKVReplica": DeploymentState(status="HEALTHY", replicas={"RUNNING": 2}),
            "RadixKVIngress": DeploymentState(
                status="UPDATING", message=message, replicas={"PENDING_ALLOCATION": 1}
            ),
        },
    )


def test_wait_returns_once_running() -> None:
    clock = FakeClock()
    get = _states(None, _deploying(), _deploying(), AppState(status="RUNNING"))
    waited = wait_until_running(
        get,  # type: ignore[arg-type]
        app_name="radixkv",
        timeout_s=60,
        poll_s=0.5,
        clock=clock,
        sleep=clock.sleep,
    )
    assert waited == pytest.approx(1.5)  # three polls before RUNNING


def test_wait_times_out_with_rays_reason_and_the_flag() -> None:
    clock = FakeClock()
    progress: list[str] = []
    with pytest.raises(DeploymentNotReady) as e:
        wait_until_running(
            _states(_deploying(UNSCHEDULABLE)),  # type: ignore[arg-type]
            app_name="radixkv",
            timeout_s=90,
            poll_s=1.0,
            progress_every_s=30,
            on_progress=progress.append,
            clock=clock,
            sleep=clock.sleep,
        )
    msg = str(e.value)
    assert "'radixkv' was not ready after 90 s (--ready-timeout 90)" in msg
    assert "RadixKVIngress UPDATING (1 PENDING_ALLOCATION)" in msg
    assert "total resources available: {'CPU': 0.0}" in msg  # Ray's explanation, passed on
    assert "RadixKVReplica" not in msg  # healthy deployments are not what is in the way
    assert clock.now == pytest.approx(90)
    assert len(progress) == 2 and all("RadixKVIngress UPDATING" in p for p in progress)


def test_wait_fails_at_once_when_the_deployment_failed() -> None:
    clock = FakeClock()
    failed = AppState(
        status="DEPLOY_FAILED",
        message="application failed",
        deployments={
            "RadixKVReplica": DeploymentState(
                status="DEPLOY_FAILED", message="The replica's constructor raised: no model 'x'"
            )
        },
    )
    with pytest.raises(DeploymentNotReady, match="failed to deploy: DEPLOY_FAILED; RadixKVRe"):
        wait_until_running(
            _states(_deploying(), failed),  # type: ignore[arg-type]
            app_name="radixkv",
            timeout_s=600,
            clock=clock,
            sleep=clock.sleep,
        )
    assert clock.now == pytest.approx(0.5)  # one poll, not the whole timeout


def test_wait_without_a_deadline_keeps_waiting() -> None:
    clock = FakeClock()
    get = _states(*([_deploying(UNSCHEDULABLE)] * 5000), AppState(status="RUNNING"))
    waited = wait_until_running(
        get,  # type: ignore[arg-type]
        app_name="radixkv",
        timeout_s=None,
        poll_s=1.0,
        clock=clock,
        sleep=clock.sleep,
    )
    assert waited == pytest.approx(5000)


def test_app_state_reads_rays_status_objects() -> None:
    """Ray's status objects are read by attribute and their enums by value (duck-typed here
    with Ray's own enums, so a renamed field or value fails this test)."""
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentStatus, ReplicaState
    from ray.serve.schema import ApplicationStatus

    status = SimpleNamespace(
        applications={
            "radixkv": SimpleNamespace(
                status=ApplicationStatus.DEPLOYING,
                message="",
                deployments={
                    "RadixKVIngress": SimpleNamespace(
                        status=DeploymentStatus.UPDATING,
                        message=UNSCHEDULABLE,
                        replica_states={ReplicaState.STARTING: 1},
                    )
                },
            )
        }
    )
    got = app_state(status, "radixkv")
    assert got == AppState(
        status="DEPLOYING",
        deployments={
            "RadixKVIngress": DeploymentState(
                status="UPDATING", message=UNSCHEDULABLE, replicas={"STARTING": 1}
            )
        },
    )
    assert app_state(status, "other") is None


def test_docs_show_the_lines_serve_ray_prints() -> None:
    """docs/cluster.md quotes the plan line and the does-not-fit error: they must stay true."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text()
    assert f"radixkv serve-ray: {plan_cpus(replicas=4, available_cpus=2.0).describe()}\n" in doc
    with pytest.raises(FleetDoesNotFit) as e:
        plan_cpus(replicas=4, available_cpus=2.0, replica_cpus=1.0)
    assert f"radixkv serve-ray: error: {e.value}\n" in doc
