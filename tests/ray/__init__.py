"""Real Ray on one machine: the local backend, and the workloads as Ray runs them."""
