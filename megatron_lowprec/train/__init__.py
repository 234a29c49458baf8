"""The Hydra training app ``lowprec-train``: config schema, setup, loop, evaluation, checkpoints."""
