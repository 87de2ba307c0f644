"""From a config to tensors with values: the init recipe (``init_recipe``), the seed writer
(``seed``), opening a checkpoint as a model family's (``model_checkpoint``), where a run starts
(``start``), building and loading this rank's stages (``stages``) and the memory plan
(``memory_plan``)."""
