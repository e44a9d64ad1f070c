import os

import pytest


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """A temporary Prefect server/database for the flows under test (Prefect's own test harness)."""
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
