"""What the operators and sensors share: the connection and cluster reference (:mod:`.base`), the readiness
wait, the slice checks, capacity fallback, ownership of jobs and objects, deletion and expiry, lineage and the
links on a task's page. A DAG author imports operators and sensors, not these."""
