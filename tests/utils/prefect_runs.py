"""The tests share one Prefect server per session: the runs of a deployment, and clearing them, so that a
run one test leaves scheduled is not found by the next."""

from __future__ import annotations


def deployment_runs(deployment: str) -> list:
    """Every run of ``deployment`` ("flow/name"), oldest first; [] when it is not registered."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            return []
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
    return sorted(runs, key=lambda r: r.created)


def clear_runs(*deployments: str) -> None:
    """Delete every run of these deployments."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for deployment in deployments:
            for run in deployment_runs(deployment):
                client.delete_flow_run(run.id)
