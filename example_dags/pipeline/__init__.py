"""Example user code for the TPU pipeline: data, batch transforms, a small Flax model, its train loop.

Shipped to the Ray cluster with the job (runtime_env ``py_modules``) and referenced by
import path, e.g. ``pipeline.transforms:normalise``. Nothing here imports the
orchestrator; JAX and Flax are imported where they are used.
"""
