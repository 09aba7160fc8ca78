"""Example serving code: a small JAX/Flax model behind Ray Serve, deployed as a RayService.

Referenced by import path (``serving.model:build_app``) from the Serve config; the Ray
workers import it from their ``PYTHONPATH`` (or a runtime_env ``py_modules`` URI). No
weights are downloaded: the parameters derive from the model version.
"""
