"""The job configuration: TOML + ``--section.key`` overrides into a frozen ``JobConfig``
(``job_config``), then fitted once to the world size and the checkpoints (``resolve``)."""
