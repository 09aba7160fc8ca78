"""Sensors that wait for Ray clusters and services."""
