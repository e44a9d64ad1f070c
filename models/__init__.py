"""Pure model code: policies and tokenizers, inference engines, advantage and loss registries, the DeepSpeed
trainer. Imports no Prefect, MLflow or DVC (tests/test_layering.py)."""
