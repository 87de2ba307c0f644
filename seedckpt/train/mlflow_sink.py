"""MLflow as a metrics sink (``metrics.mlflow``): each step's row as MLflow metrics of one run.

The run lives in the tracking store ``metrics.mlflow_tracking_uri`` (default: an SQLite file,
``job.dump_folder/mlflow.db``, which ``mlflow ui --backend-store-uri sqlite:///...`` opens; MLflow 3
keeps its file store read-only, so SQLite is the local default). Its id is kept in
``job.dump_folder/mlflow_run_id``, so a resumed run continues the same MLflow run, as the W&B sink
does. The job's config goes in as the run's parameters, once, when the run is created (MLflow
refuses to change a logged parameter). The client API is used rather than MLflow's fluent one, so no
process-global active run is left behind.
"""

from __future__ import annotations

import time
from pathlib import Path

from seedckpt.utils.errors import SeedckptError

MLFLOW_RUN_ID = "mlflow_run_id"  # in job.dump_folder: the MLflow run a resumed run continues
MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value


def check_mlflow():
    """The ``mlflow`` package, or one line naming the extra (checked before any rendezvous)."""
    try:
        import mlflow
    except ImportError:
        raise SeedckptError("metrics.mlflow needs the mlflow package: pip install 'seedckpt[mlflow]'") from None
    return mlflow


def default_tracking_uri(folder: Path) -> str:
    return f"sqlite:///{(folder / 'mlflow.db').resolve()}"


class MlflowSink:
    """One MLflow run, created or (with ``folder/mlflow_run_id``) resumed."""

    def __init__(self, folder: Path, tracking_uri: str, experiment: str, name: str, config: dict):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri or default_tracking_uri(folder))
        id_file = folder / MLFLOW_RUN_ID
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.client.log_batch(self.run_id, params=_params(config))
        partial = id_file.with_name(f".{id_file.name}.partial")
        partial.write_text(self.run_id + "\n")
        partial.replace(id_file)

    def log(self, record: dict, constant_fields: tuple[str, ...]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(key, float(value), now, record["step"])
            for key, value in record.items()
            if key not in constant_fields and isinstance(value, (int, float))
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _params(config: dict, prefix: str = "") -> list:
    """The nested config as MLflow parameters ``section.key``, each value as text within MLflow's limit."""
    from mlflow.entities import Param

    params = []
    for key, value in config.items():
        if isinstance(value, dict):
            params += _params(value, f"{prefix}{key}.")
        else:
            params.append(Param(f"{prefix}{key}", str(value)[:MAX_PARAM_CHARS]))
    return params
