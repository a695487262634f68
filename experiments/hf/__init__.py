"""Hugging Face checkpoints: the folder read and checked (``checkpoint``) and its tensors mapped to
the Praxis model's parameter tree (``convert``); ``python -m experiments.import_hf`` runs both."""
