import pytest


@pytest.fixture
def stand_in_stages(monkeypatch):
    """Runs the pipeline flow on stand-in stages: stand_in_stages(execute_stage, is_stale) replaces the stage code,
    the MLflow parent run, the retry back-off and DVC's status/commit (a stage runs iff is_stale(name)), so the
    Prefect wiring is what a test sees. Returns the patched flows.pipeline module."""
    from contextlib import contextmanager

    import flows.pipeline as pipeline
    from tasks.tracking import ParentRun

    @contextmanager
    def no_mlflow_run(layout, params):
        yield ParentRun("no-mlflow")

    def patch(execute_stage, is_stale):
        monkeypatch.setattr(pipeline, "execute_stage", execute_stage)
        monkeypatch.setattr(pipeline, "pipeline_run", no_mlflow_run)
        monkeypatch.setattr(pipeline, "RETRY_BACKOFF_S", 0)
        monkeypatch.setattr(pipeline.dvc_sync, "check_dvc_yaml", lambda params, layout: None)
        monkeypatch.setattr(pipeline.dvc_sync, "is_stale", lambda layout, name: is_stale(name))
        monkeypatch.setattr(pipeline.dvc_sync, "commit", lambda layout, name: None)
        return pipeline

    return patch
