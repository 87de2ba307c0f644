"""Training tokens: synthetic and text sources and the ``Batch`` they make (``sources``), chat
conversations with assistant-only labels (``chat``), tokenizers (``tokenizer``), and the choice
among them by ``data.kind`` (``datasets``)."""
