"""Pure model code: policies and tokenizers, inference engines, advantage and loss registries, the DeepSpeed
trainer. Imports no Prefect, MLflow or DVC (tests/test_layering.py)."""
import logging as _logging


def _drop_cpu_fallback_warning(record: _logging.LogRecord) -> bool:
    """DeepSpeed warns "Setting accelerator to CPU" on every import (transformers and accelerate import it too)
    where no GPU is visible: noise on a CPU machine, so it is dropped there. Where a GPU is visible the warning
    means detection failed, and it is kept."""
    if not str(record.msg).startswith("Setting accelerator to CPU"):
        return True
    import torch  # loaded already: DeepSpeed's detection imported it

    return torch.cuda.is_available()


# the filter outlives DeepSpeed's own set-up of its logger (which adds a handler but keeps the logger's filters)
_logging.getLogger("DeepSpeed").addFilter(_drop_cpu_fallback_warning)
