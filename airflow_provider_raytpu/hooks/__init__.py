"""Hooks: the raytpu connection and the Ray Jobs API."""
