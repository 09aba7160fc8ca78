"""Programs that run on the Ray cluster as Ray jobs; they never import Airflow."""
