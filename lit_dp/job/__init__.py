"""The job: the launcher's environment, Lightning's view of it, and the process group."""
