"""Airflow provider for Ray on TPU slices."""
