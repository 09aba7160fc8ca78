"""Operators a DAG author writes."""
