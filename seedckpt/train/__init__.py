"""The training run: the trainer's loop (``trainer``), what a ``step-N`` holds (``state``), per-step
telemetry (``metrics``) and one report per failure across ranks (``failures``)."""
