"""Runs each time ``nightly_finetune`` has a new model serving, and reads what its asset events say.

``nightly_finetune`` declares two assets: ``finetuned_regressor_checkpoints`` (its training task:
the checkpoint, its step, the restarts it cost) and ``finetuned_regressor`` (its serving sensor, once
the promoted version answers: the service and the served version). This DAG is scheduled on the
served model and records each promotion; put a batch job that must use the newest model here
(nightly embeddings, an evaluation) in its place.
"""

from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Asset, task

SERVED_MODEL = Asset("finetuned_regressor")


def promotions(triggering_asset_events: Any) -> list[dict[str, Any]]:
    """What each new serving event says, oldest first: the service, the served version and when."""
    return [{"service": event.extra.get("service"), "served_version": event.extra.get("served_version"),
             "at": event.timestamp.isoformat()}
            for event in triggering_asset_events[SERVED_MODEL]]


with DAG("after_promotion", schedule=[SERVED_MODEL], start_date=datetime(2026, 12, 1), catchup=False,
         tags=["raytpu", "serving"]):

    @task
    def record_promotion(triggering_asset_events: Any = None) -> list[dict[str, Any]]:
        """Log and return each promotion this run was triggered by."""
        found = promotions(triggering_asset_events)
        for promotion in found:
            print(f"{promotion['service']} serves {promotion['served_version']} since {promotion['at']}")
        return found

    record_promotion()
