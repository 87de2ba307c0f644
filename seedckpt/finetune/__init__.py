"""Fine-tuning: the model and vocabulary a fine-tune starts from (``pretrained``) and orthogonal
subspace fine-tuning (``osft``)."""
