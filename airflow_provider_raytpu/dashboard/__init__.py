"""Ray's dashboard REST APIs (Jobs, Serve, State), reached over a transport a backend gives: no Ray in Airflow."""
