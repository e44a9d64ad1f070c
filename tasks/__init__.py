"""One module per pipeline stage (run(params, layout[, round]) -> metrics), the params loader and the stage
outputs helper; flows/ runs them under Prefect and DVC."""
