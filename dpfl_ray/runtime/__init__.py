"""The only Ray code: the coordinator and worker actors, resources, connect and shutdown, checkpoints and jobs."""
